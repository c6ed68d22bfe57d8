"""llama-server, built from the llama.cpp vendored in the pinned llama-cpp-python sdist: the server kvroute is
compared with. Built once (cmake, CPU, no network features; a few minutes on 2 cores) and cached, by the same rule as
the workers' llama.cpp (common/build.py: a native build with AMX compiled out on x86-64, the user's CMAKE_ARGS,
CFLAGS and CXXFLAGS added), so that both run the same kernels, and neither crashes where llama.cpp's AMX kernels
fault (found on an AMX Xeon: a native llama-server exited with SIGSEGV before it was ready).

    .venv/bin/python -m bench.llama_server      # build if needed, print the binary's path
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

from common.build import this_machine
from common.model import cache_dir as model_cache_dir

LLAMA_CPP_PYTHON = version("llama-cpp-python")  # the pinned version: the same llama.cpp as the workers
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # (it would download the web UI)
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


def cache_dir() -> Path:
    return model_cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON}"


def binary() -> Path:
    """The llama-server binary, built first when it is not cached (one per build key: flags and CPU features);
    $KVROUTE_LLAMA_SERVER when set (one built with the workers' llama.cpp elsewhere: bench/gpu/device.sh)."""
    if env := os.environ.get("KVROUTE_LLAMA_SERVER"):
        return Path(env)
    rule = this_machine()
    for note in rule.notes:
        print(f"llama-server build: {note}", file=sys.stderr)
    out = cache_dir() / f"llama-server-{rule.key}"
    if out.exists():
        return out
    env = {**os.environ, "CFLAGS": rule.cflags, "CXXFLAGS": rule.cxxflags}
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        src = _vendored_llama_cpp(Path(tmp))
        build = Path(tmp) / "build"
        jobs = str(os.cpu_count() or 2)
        configure = ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS, *rule.cmake_args.split()]
        subprocess.run(configure, check=True, env=env)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True, env=env)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", out)
    return out


def _vendored_llama_cpp(tmp: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist of the pinned version (pip downloads it)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(tmp),
         f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
        check=True,
    )  # fmt: skip
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"


if __name__ == "__main__":
    print(binary())
