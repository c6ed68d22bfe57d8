"""The package layers hold: no module imports a layer above its own (import-linter reads pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_imports_a_layer_above_it() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_every_package_is_in_a_layer() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {p.strip() for layer in config["contracts"][0]["layers"] for p in layer.split("|")}
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert set(config["root_packages"]) == layered == packages - {"tests", "bench"}


def test_every_module_of_the_worker_and_the_router_is_in_its_layers() -> None:
    """A new module of either process goes in its contract's layers, or nothing checks what it imports."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    for package in ("worker", "router"):
        layers = next(c["layers"] for c in contracts if c["layers"][0].startswith(f"{package}."))
        layered = {m.strip() for layer in layers for m in layer.split("|")}
        modules = {f"{package}.{p.stem}" for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
        assert modules - layered == set(), f"{package} modules outside the import-linter layers"
