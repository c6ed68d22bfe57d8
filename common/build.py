"""How llama-cpp-python is built for this machine, and the wheel cache keyed by everything that build depends on.

Standard library only: `scripts/setup` runs this file before the virtual environment holds anything.

    python common/build.py ensure --python .venv/bin/python   # install the right build into that environment
    python common/build.py show                                # the flags, the key and the cache directory

The rule (docs/setup.md, "The llama.cpp build"):
- llama.cpp is built with `GGML_NATIVE` (llama-cpp-python's default): the instructions of the CPU it is built on.
- On x86-64, AMX is always compiled out (`-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`). llama.cpp's AMX kernels
  fault at their first tile instruction on common Sapphire Rapids and later Xeons (llama.cpp issue 20824: the
  permission to use tiles is asked for on one thread, the kernels run on others), so a native build crashes at
  the first request there. A probe that runs a tile instruction in a child process would pass where llama.cpp
  still crashes, so it cannot decide this. AMX speeds up only some quantized matrix products on those CPUs;
  `KVROUTE_LLAMA_AMX=on` turns it back on.
- AVX-512 and the other extensions `GGML_NATIVE` may enable are kept: the compiler's `-march=native` enables
  them only where the OS saves their registers (XCR0), so the OS cannot refuse them.
- A user's own `CMAKE_ARGS` (CUDA, Metal, BLAS), `CFLAGS` and `CXXFLAGS` reach the build, with the above added.

pip caches a built wheel by its name and version alone, so a wheel once built with other flags, or on another CPU,
would come back from pip's cache. So the wheel is built with pip's cache off, into a directory of its own whose
name is a hash of the version, the flags and the CPU's features; an environment records the key it was installed
with (`kvroute-llama-build.json` in its prefix) and is reinstalled when the wanted key differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
AMX_SWITCH = "KVROUTE_LLAMA_AMX"  # "on": keep llama.cpp's AMX kernels in a native build
MARKER = "kvroute-llama-build.json"  # in the environment's prefix: the key its llama-cpp-python was built with
# CPU flags that change what a native build compiles in: a build is kept per set of them
ISA_FLAG = re.compile(r"^(sse|ssse|avx|amx|fma|f16c|bmi|vnni|vaes|vpclmul|gfni|sha|aes|pclmul|popcnt|lzcnt|movbe)")


@dataclass(frozen=True)
class Build:
    """What one llama-cpp-python build is made with; `key` names its wheel directory."""

    requirement: str  # llama-cpp-python==X.Y.Z, as pinned in pyproject.toml
    machine: str  # x86_64, aarch64, ...
    cpu_flags: tuple[str, ...]  # the CPU's instruction-set flags (a native build depends on them)
    cmake_args: str
    cflags: str
    cxxflags: str
    amx: bool  # AMX kernels compiled in
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        data = json.dumps([self.requirement, self.machine, self.cpu_flags, self.cmake_args, self.cflags, self.cxxflags])
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def env(self) -> dict[str, str]:
        return {"CMAKE_ARGS": self.cmake_args, "CFLAGS": self.cflags, "CXXFLAGS": self.cxxflags}


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The instruction-set flags of /proc/cpuinfo's first processor (Linux lists only what the OS enabled)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, Arm
            return tuple(sorted({f for f in value.split() if ISA_FLAG.match(f) or name.strip() == "Features"}))
    return ()


def requirement(pyproject: Path = ROOT / "pyproject.toml") -> str:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return next(d for d in deps if d.replace("_", "-").startswith("llama-cpp-python=="))


def wanted(env: dict[str, str], machine: str, flags: tuple[str, ...], req: str, knows_amx: bool = True) -> Build:
    """The build for a machine: the user's CMAKE_ARGS/CFLAGS/CXXFLAGS, AMX compiled out on x86-64 unless asked for.
    `knows_amx`: the compiler accepts the AMX flags (GCC 11 and later); one that does not cannot emit AMX either."""
    cmake_args = env.get("CMAKE_ARGS", "").strip()
    cflags, cxxflags = env.get("CFLAGS", "").strip(), env.get("CXXFLAGS", "").strip()
    notes = []
    x86 = machine.lower() in ("x86_64", "amd64")
    amx_asked = env.get(AMX_SWITCH, "").strip().lower() in ("1", "on", "yes", "true")
    if x86 and not amx_asked and knows_amx:
        cflags = " ".join(filter(None, [cflags, *AMX_OFF]))
        cxxflags = " ".join(filter(None, [cxxflags, *AMX_OFF]))
        if any(f.startswith("amx") for f in flags):
            notes.append(f"this CPU has AMX; llama.cpp's AMX kernels are compiled out ({AMX_SWITCH}=on keeps them)")
    amx = x86 and amx_asked
    return Build(req, machine, flags, cmake_args, cflags, cxxflags, amx, tuple(notes))


def this_machine(env: dict[str, str] | None = None) -> Build:
    env = dict(os.environ if env is None else env)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return wanted(env, platform.machine(), cpu_flags(), requirement(), knows_amx=not x86 or compilers_know_amx(env))


def compilers_know_amx(env: dict[str, str]) -> bool:
    """Whether the C and C++ compilers the build will use accept the AMX flags (a missing compiler: assume so, and
    let the build itself say it is missing)."""
    for compiler, lang in ((env.get("CC", "cc"), "c"), (env.get("CXX", "c++"), "c++")):
        try:
            done = subprocess.run([*compiler.split(), *AMX_OFF, "-x", lang, "-fsyntax-only", "-"], input="",
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode != 0 and "amx" in done.stderr:
            return False
    return True


def cache_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ if env is None else env)
    if env.get("KVROUTE_WHEEL_CACHE"):
        return Path(env["KVROUTE_WHEEL_CACHE"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "kvroute" / "wheels"


def installed_key(prefix: Path) -> str | None:
    """The key the environment at `prefix` recorded when its llama-cpp-python was installed (None: none recorded)."""
    try:
        return str(json.loads((prefix / MARKER).read_text())["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plan(build: Build, recorded: str | None, cached_wheel: Path | None) -> str:
    """What `ensure` does: "keep" (the environment has this build), "install" (the cached wheel of this build),
    or "build" (build it first). A build recorded under another key, or none recorded (an environment from before
    this rule, or one pip filled from its own cache), is replaced whatever pip believes is installed."""
    if recorded == build.key:
        return "keep"
    return "install" if cached_wheel is not None else "build"


def cached_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob("llama_cpp_python-*.whl")) if directory.is_dir() else []
    return wheels[-1] if wheels else None


def _pip(python: str, *args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True, env=env)


def ensure(python: str, build: Build, wheels: Path) -> str:
    """Install `build` of llama-cpp-python into the environment of `python`, building its wheel once per key."""
    prefix = Path(subprocess.run([python, "-c", "import sys; print(sys.prefix)"], check=True, capture_output=True,
                                 text=True).stdout.strip())  # fmt: skip
    directory = wheels / build.key
    action = plan(build, installed_key(prefix), cached_wheel(directory))
    for note in build.notes:
        print(f"kvroute build: {note}", file=sys.stderr)
    if action == "keep":
        return action
    if action == "build":
        print(f"kvroute build: building {build.requirement} for this machine (key {build.key}; several minutes)",
              file=sys.stderr)  # fmt: skip
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{build.key}-"))
        try:
            _pip(python, "wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python", "-w", str(tmp),
                 build.requirement, env={**os.environ, **build.env()})  # fmt: skip
            (tmp / "build.json").write_text(json.dumps(asdict(build), indent=1))
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(tmp, directory)  # whole or not at all: an interrupted build leaves no wheel to trust
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    wheel = cached_wheel(directory)
    assert wheel is not None
    _pip(python, "install", "-q", "--force-reinstall", "--no-deps", str(wheel))
    _pip(python, "install", "-q", str(wheel))  # its own dependencies, if missing
    info = system_info(python)
    if not build.amx and "AMX" in info:  # the flags did not reach the compiler: say so rather than crash later
        raise BuildError(f"the installed llama.cpp still has AMX kernels ({info.strip()}); the flags were {build.env()}")
    (prefix / MARKER).write_text(json.dumps({**asdict(build), "key": build.key, "wheel": wheel.name}, indent=1))
    return action


class BuildError(Exception):
    pass


def system_info(python: str) -> str:
    """llama.cpp's own list of what the build in that environment has (llama_print_system_info)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="common/build.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["ensure", "show"])
    parser.add_argument("--python", default=sys.executable, help="the environment's Python (ensure)")
    args = parser.parse_args(argv)
    build = this_machine()
    if args.action == "show":
        print(json.dumps({**asdict(build), "key": build.key, "cache": str(cache_dir() / build.key)}, indent=1))
        return 0
    try:
        action = ensure(args.python, build, cache_dir())
    except BuildError as exc:
        print(f"kvroute build: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"kvroute build: {' '.join(exc.cmd[:4])} ... failed (exit {exc.returncode}); the build flags were "
              f"{json.dumps(build.env())}", file=sys.stderr)  # fmt: skip
        return 1
    print(f"kvroute build: llama-cpp-python {action} (key {build.key})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
