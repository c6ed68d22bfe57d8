"""systemd's notify protocol (sd_notify) without libsystemd: one datagram to $NOTIFY_SOCKET per call; and its
watchdog's stand-in where there is no systemd: a file touched while the process is healthy (--alive-file), which a
liveness probe checks (deploy/kubernetes)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

ALIVE_S = 5.0  # an --alive-file is touched this often (a probe allows several times more)


def notify(*, ready: bool = False, stopping: bool = False, status: str | None = None, watchdog: bool = False) -> bool:
    """Tell systemd READY=1 / STOPPING=1 / STATUS=... / WATCHDOG=1. Returns False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    lines = []
    if ready:
        lines.append("READY=1")
    if stopping:
        lines.append("STOPPING=1")
    if watchdog:
        lines.append("WATCHDOG=1")
    if status is not None:
        lines.append("STATUS=" + status.replace("\n", " "))
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # a listener that stops reading must never stall the caller's loop
            sock.sendto("\n".join(lines).encode(), address)
    except OSError:
        return False  # systemd went away: nothing to tell, nothing to fail
    return True


def watchdog_interval_s(alive_file: str | None = None) -> float | None:
    """How often to say the process is alive (`alive`): half of $WATCHDOG_USEC in seconds when systemd's watchdog is
    on for this process, else ALIVE_S when there is an `alive_file`, else None (never)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    fallback = ALIVE_S if alive_file else None
    if not usec or (pid and pid != str(os.getpid())):
        return fallback
    try:
        return int(usec) / 2e6
    except ValueError:
        return fallback


def alive(alive_file: str | None) -> None:
    """The process is healthy: systemd's WATCHDOG=1, and `alive_file` touched (a file that cannot be touched is not
    a reason to stop serving: the probe that reads it will say so)."""
    notify(watchdog=True)
    if alive_file:
        with contextlib.suppress(OSError):
            Path(alive_file).touch()
