"""SGLang's model gateway (`smg` on PyPI), the cache-aware router kvroute is compared with in front of several
llama-servers (bench/systems.py `smg-cache-aware`, `smg-round-robin`). Installed once into its own virtual environment
under the cache (pip, a wheel of its Rust binary; nothing of it enters kvroute's environment).

    .venv/bin/python -m bench.smg      # install if needed, print the binary's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from common.model import cache_dir

VERSION = "1.13.0"  # the release the figures were measured with


def binary() -> Path:
    """The `smg` command, installed first when it is not cached; $KVROUTE_SMG when set."""
    if env := os.environ.get("KVROUTE_SMG"):
        return Path(env)
    home = cache_dir() / f"smg-{VERSION}"
    out = home / "bin" / "smg"
    if out.exists():
        return out
    venv.EnvBuilder(with_pip=True, clear=True).create(home)
    subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "-q", f"smg=={VERSION}"], check=True)
    if not out.exists():
        raise RuntimeError(f"smg {VERSION} installed no `smg` command in {home}")
    return out


if __name__ == "__main__":
    print(binary())
    sys.exit(0)
