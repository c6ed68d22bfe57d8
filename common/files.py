"""Files only this user can read (issue 46): what kvroute writes on a shared host (disk-tier states with token ids in
their headers, start records, IPC sockets, generated keys) goes in directories of mode 0700 that this user owns, as
files of mode 0600, created without following a symbolic link. A directory that is a link, or another user's, is
refused, never used: in a shared /tmp another user could have made /tmp/kvroute-UID first, or a link named like a
file kvroute is about to write.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: made (mode 0700) if missing, else checked to be a directory
    this user owns, not a symbolic link, and made 0700. Raises PermissionError saying what is wrong."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=PRIVATE_DIR, parents=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory of its own (a symbolic link or a file): not used")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user (uid {st.st_uid}): not used")
    if stat.S_IMODE(st.st_mode) != PRIVATE_DIR:
        os.chmod(path, PRIVATE_DIR)
    return path


def runtime_base() -> Path:
    """Where this user's runtime files go: a `kvroute` directory in $RUNTIME_DIRECTORY (systemd's) or
    $XDG_RUNTIME_DIR, else kvroute-UID in the temporary directory (not checked yet: `runtime_dir`)."""
    base = os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR")
    return Path(base.split(":")[0]) / "kvroute" if base else Path(tempfile.gettempdir()) / f"kvroute-{os.getuid()}"


def runtime_dir() -> Path:
    """`runtime_base()`, made or checked to be this user's alone (`private_dir`)."""
    return private_dir(runtime_base())


def open_private(path: Path, flags: int) -> int:
    """A file descriptor of `path` opened with `flags` (O_CREAT: mode 0600), never through a symbolic link."""
    return os.open(path, flags | NO_FOLLOW, PRIVATE_FILE)


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` at once (a temporary file beside it, renamed), mode 0600."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def made_once(path: Path, make: Callable[[Path], None]) -> Path:
    """`path`, made on first use by `make(tmp)` into a file beside it, then renamed: whole or not at all, also when
    processes side by side make it at once (a derived model in the cache)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            make(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # (a half-made file would stay in the cache for good)
            raise
    return path
