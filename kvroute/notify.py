"""systemd's notify protocol (sd_notify) without libsystemd: one datagram to $NOTIFY_SOCKET per call."""

from __future__ import annotations

import os
import socket


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


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC in seconds when systemd's watchdog is on for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
