"""The competitor's build follows the workers' llama.cpp build rule (common/build.py): on x86-64, AMX compiled out,
so that llama-server runs where llama.cpp's AMX kernels fault (an AMX Xeon: SIGSEGV before it was ready)."""

from __future__ import annotations

from pathlib import Path

import bench.llama_server as ls
from common.build import AMX_OFF, wanted


def test_llama_server_is_built_with_the_workers_flags_and_cached_under_their_key(monkeypatch, tmp_path):
    rule = wanted({"CMAKE_ARGS": "-DGGML_BLAS=ON"}, "x86_64", ("amx_tile", "avx512f"), "llama-cpp-python==0.3.36")
    monkeypatch.setattr(ls, "this_machine", lambda: rule)
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(ls, "_vendored_llama_cpp", lambda tmp: Path(tmp) / "src")
    runs: list[tuple[list[str], dict[str, str]]] = []

    def run(cmd: list[str], check: bool, env: dict[str, str]) -> None:
        runs.append((cmd, env))
        if "--build" in cmd:
            out = Path(cmd[cmd.index("--build") + 1]) / "bin"
            out.mkdir(parents=True)
            (out / "llama-server").write_text("binary")

    monkeypatch.setattr(ls.subprocess, "run", run)
    path = ls.binary()
    assert path == ls.cache_dir() / f"llama-server-{rule.key}" and path.read_text() == "binary"
    (configure, env), (_, build_env) = runs
    assert "-DGGML_BLAS=ON" in configure and "-DLLAMA_BUILD_SERVER=ON" in configure
    assert all(flag in env["CFLAGS"].split() and flag in env["CXXFLAGS"].split() for flag in AMX_OFF)
    assert build_env["CFLAGS"] == env["CFLAGS"]
    runs.clear()
    assert ls.binary() == path and runs == []  # cached: not built again
