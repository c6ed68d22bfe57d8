"""The systemd units pass `systemd-analyze verify` (with the paths pointed at this checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KVROUTE_BIN = Path(sys.executable).parent / "kvroute"


@pytest.fixture
def units(tmp_path: Path) -> Path:
    for unit in DEPLOY.glob("*.service"):
        text = unit.read_text().replace("/opt/kvroute/.venv/bin/kvroute", str(KVROUTE_BIN))
        text = text.replace("/etc/kvroute/", f"{tmp_path}/")
        (tmp_path / unit.name).write_text(text)
    for env in DEPLOY.glob("*.env"):
        shutil.copy(env, tmp_path / env.name)
    (tmp_path / "kvroute-worker@0.service").write_text((tmp_path / "kvroute-worker@.service").read_text())
    return tmp_path


def test_units_verify_cleanly(units: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed; CI installs systemd (apt-get install systemd)")
    assert KVROUTE_BIN.exists(), f"{KVROUTE_BIN} missing: install the package first"
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(units / "kvroute-router.service"), str(units / "kvroute-worker@0.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if "kvroute" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_units_are_notify_type_hardened_and_restart(units: Path) -> None:
    for name in ("kvroute-router.service", "kvroute-worker@.service"):
        text = (DEPLOY / name).read_text()
        for line in (
            "Type=notify",
            "Restart=on-failure",
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "PrivateTmp=yes",
            "User=kvroute",
            "KillSignal=SIGTERM",
        ):
            assert line in text.splitlines(), f"{name} lacks {line}"
        assert any(line.startswith("WatchdogSec=") for line in text.splitlines()), f"{name} sets no WatchdogSec"
    assert "RestartPreventExitStatus=3" in (DEPLOY / "kvroute-worker@.service").read_text()  # refused: no restart loop
    assert "--gpu %i" in (DEPLOY / "kvroute-worker@.service").read_text()
