"""The llama.cpp build rule and its wheel cache (common/build.py): what the setup scripts do, given a machine's CPU
features, the user's flags and what an environment and the cache hold. No build is run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common import build

REQ = "llama-cpp-python==0.3.36"
SPR = ("avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16")  # a Sapphire Rapids Xeon
ZEN4 = ("avx2", "avx512f", "avx512_vnni")


def test_x86_builds_compile_amx_out_whatever_the_cpu_and_say_so_where_it_has_amx():
    for flags in (SPR, ZEN4, ("avx2",)):
        b = build.wanted({}, "x86_64", flags, REQ)
        assert b.cflags.split() == list(build.AMX_OFF) and b.cxxflags.split() == list(build.AMX_OFF)
        assert not b.amx
    assert any("AMX" in n for n in build.wanted({}, "x86_64", SPR, REQ).notes)
    assert not build.wanted({}, "x86_64", ZEN4, REQ).notes


def test_the_switch_keeps_amx_and_other_machines_get_no_x86_flags():
    on = build.wanted({build.AMX_SWITCH: "on"}, "x86_64", SPR, REQ)
    assert on.amx and "-mno-amx" not in on.cflags
    arm = build.wanted({}, "aarch64", ("fp", "asimd", "sve"), REQ)
    assert arm.cflags == "" and arm.cxxflags == "" and not arm.amx


def test_a_compiler_without_the_amx_flags_gets_none_and_this_one_knows_them(tmp_path):
    old = build.wanted({}, "x86_64", SPR, REQ, knows_amx=False)  # GCC 10: rejects -mno-amx-*, cannot emit AMX either
    assert old.cflags == "" and old.cxxflags == "" and not old.amx
    assert build.compilers_know_amx({})
    fake = tmp_path / "gcc10"
    fake.write_text("#!/bin/sh\necho \"cc: error: unrecognized command-line option '-mno-amx-tile'\" >&2; exit 1\n")
    fake.chmod(0o755)
    assert not build.compilers_know_amx({"CC": str(fake), "CXX": str(fake)})


def test_the_users_own_flags_reach_the_build():
    env = {"CMAKE_ARGS": "-DGGML_CUDA=on", "CFLAGS": "-O3", "CXXFLAGS": "-g"}
    b = build.wanted(env, "x86_64", SPR, REQ)
    assert b.env() == {
        "CMAKE_ARGS": "-DGGML_CUDA=on",
        "CFLAGS": "-O3 " + " ".join(build.AMX_OFF),
        "CXXFLAGS": "-g " + " ".join(build.AMX_OFF),
    }


def test_the_key_changes_with_the_flags_the_cpu_and_the_version_and_nothing_else():
    base = build.wanted({}, "x86_64", ZEN4, REQ)
    assert build.wanted({}, "x86_64", ZEN4, REQ).key == base.key
    assert build.wanted({}, "x86_64", SPR, REQ).key != base.key
    assert build.wanted({"CMAKE_ARGS": "-DGGML_CUDA=on"}, "x86_64", ZEN4, REQ).key != base.key
    assert build.wanted({build.AMX_SWITCH: "on"}, "x86_64", ZEN4, REQ).key != base.key
    assert build.wanted({}, "x86_64", ZEN4, "llama-cpp-python==0.3.37").key != base.key
    assert build.wanted({"HOME": "/elsewhere"}, "x86_64", ZEN4, REQ).key == base.key


def test_an_environment_is_kept_only_with_its_recorded_key_else_filled_from_the_keyed_cache_or_built(tmp_path):
    b = build.wanted({}, "x86_64", SPR, REQ)
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    assert build.plan(b, b.key, None) == "keep"
    # pip believes 0.3.36 is installed in all of these; the wheel it holds may be one built with AMX (pip's cache)
    assert build.plan(b, None, None) == "build"
    assert build.plan(b, "0123456789abcdef", None) == "build"
    assert build.plan(b, None, wheel) == "install"
    assert build.plan(b, "0123456789abcdef", wheel) == "install"


def test_the_recorded_key_and_the_cached_wheel_are_read_from_their_places(tmp_path):
    assert build.installed_key(tmp_path) is None
    (tmp_path / build.MARKER).write_text(json.dumps({"key": "abc"}))
    assert build.installed_key(tmp_path) == "abc"
    (tmp_path / build.MARKER).write_text("not json")
    assert build.installed_key(tmp_path) is None
    assert build.cached_wheel(tmp_path / "nothing") is None
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"")
    assert build.cached_wheel(tmp_path / "k").name.startswith("llama_cpp_python-0.3.36")


def test_cpu_flags_keep_the_instruction_sets_of_the_first_processor():
    cpuinfo = "processor\t: 0\nflags\t\t: fpu vme avx2 avx512f amx_tile sse4_2 hypervisor\n\nprocessor\t: 1\nflags\t: fpu\n"
    assert build.cpu_flags(cpuinfo) == ("amx_tile", "avx2", "avx512f", "sse4_2")
    assert build.cpu_flags("Features\t: fp asimd sve\n") == ("asimd", "fp", "sve")


def test_the_pin_is_read_from_pyproject_and_cache_dir_follows_the_environment(tmp_path):
    assert build.requirement() == REQ
    assert build.cache_dir({"KVROUTE_WHEEL_CACHE": str(tmp_path)}) == tmp_path
    assert build.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "kvroute" / "wheels"


def test_this_environment_holds_the_build_the_rule_wants():
    """The README's commands ran common/build.py: the environment's build is the one wanted for this machine, and its
    llama.cpp has no AMX kernels."""
    assert build.installed_key(Path(sys.prefix)) == build.this_machine().key
    assert "AMX" not in build.system_info(sys.executable)


def test_show_runs_with_the_standard_library_alone():
    out = subprocess.run([sys.executable, "-S", "-I", str(build.ROOT / "common" / "build.py"), "show"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(out.stdout)["key"] == build.this_machine().key


def test_ensure_builds_into_the_keyed_directory_whole_then_installs_and_records_the_key(tmp_path, monkeypatch):
    """The steps of `ensure`, with pip stood in for: a build lands in wheels/KEY only once complete, the environment
    records the key, the next run keeps it, and a build that still has AMX stops the setup."""
    prefix, wheels, calls = tmp_path / "venv", tmp_path / "wheels", []
    prefix.mkdir()

    def pip(python, *args, env=None):
        calls.append(args[0])
        if args[0] == "wheel":
            out = Path(args[args.index("-w") + 1])
            assert out.parent == wheels and not (wheels / b.key).exists()  # built aside, moved in whole
            assert env is not None and env["CFLAGS"] == b.cflags
            (out / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"")

    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{prefix}\n")

    b = build.wanted({}, "x86_64", SPR, REQ)
    monkeypatch.setattr(build, "_pip", pip)
    monkeypatch.setattr(build.subprocess, "run", run)
    monkeypatch.setattr(build, "system_info", lambda python: "CPU : AVX512 = 1 |")
    assert build.ensure("python", b, wheels) == "build"
    assert calls == ["wheel", "install", "install"]
    assert json.loads((wheels / b.key / "build.json").read_text())["cflags"] == b.cflags
    assert build.installed_key(prefix) == b.key and [p.name for p in wheels.iterdir()] == [b.key]
    assert build.ensure("python", b, wheels) == "keep"
    (prefix / build.MARKER).unlink()
    monkeypatch.setattr(build, "system_info", lambda python: "CPU : AVX512 = 1 | AMX_INT8 = 1 |")
    with pytest.raises(build.BuildError, match="AMX"):
        build.ensure("python", b, wheels)
    assert build.installed_key(prefix) is None
