"""What kvroute writes on a shared host is its user's alone (issue item 6): disk-tier states (token ids in their
headers) and start records are created 0600 in 0700 directories, never through a symbolic link, and never in a
directory another user made first."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from common import start_record
from common.files import private_dir
from worker.disk_cache import DiskCache

FP, SV = "a1b2c3d4e5f6a7b8", "llama-cpp-python=0.3.36;seq=0x67677371/3"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def foreign_dir(tmp_path: Path) -> Path:
    """A directory another user owns (made here and given away when this runs as root, else the root's /)."""
    if os.getuid() == 0:
        path = tmp_path / "theirs"
        path.mkdir(mode=0o777)
        os.chown(path, 65534, 65534)
        return path
    return Path("/")


def test_disk_tier_files_are_0600_in_a_0700_directory(tmp_path: Path) -> None:
    """Its entry files were world-readable (0644), with the tokens of every tenant's prompts in their headers."""
    old = os.umask(0o022)
    try:
        cache = DiskCache(tmp_path / "disk" / "cpu0", 1 << 20, FP, SV)
        cache.load()
        assert cache.put([1, 2, 3], 3, 0, b"state bytes") is not None and cache.flush(5)
        cache.close()
    finally:
        os.umask(old)
    directory = tmp_path / "disk" / "cpu0"
    assert mode(directory) == 0o700
    files = list(directory.iterdir())
    assert files and all(mode(f) == 0o600 for f in files), [(f.name, oct(mode(f))) for f in files]


def test_a_disk_tier_in_another_users_directory_stays_off(tmp_path: Path) -> None:
    cache = DiskCache(foreign_dir(tmp_path), 1 << 20, FP, SV)
    assert cache.load() == [] and not cache.enabled


def test_the_start_record_is_not_written_through_a_link_nor_into_another_users_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It fell back to /tmp/kvroute-UID without checking who made that directory, and wrote through links in it."""
    for var in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the temporary directory: /tmp on a real host)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = start_record.default_path("cpu0")
    assert path.parent == tmp_path / f"kvroute-{os.getuid()}"
    # a link where the record's temporary file will be written: not followed
    path.parent.mkdir(mode=0o700)
    path.with_name(path.name + ".tmp").symlink_to(victim)
    record = start_record.StartRecord(path, "build+model")
    with record.stage("load"):
        pass
    assert victim.read_text() == "precious"
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    # the directory itself is a link to another: not used
    other = tmp_path / "other"
    other.mkdir()
    path.unlink()
    os.rename(path.parent, tmp_path / "moved")
    (tmp_path / f"kvroute-{os.getuid()}").symlink_to(other)
    start_record.StartRecord(start_record.default_path("cpu0"), "build+model").refusal()
    assert list(other.iterdir()) == []


def test_a_private_directory_is_refused_when_another_user_owns_it(tmp_path: Path) -> None:
    with pytest.raises(PermissionError, match="another user"):
        private_dir(foreign_dir(tmp_path))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="symbolic link"):
        private_dir(link)
