"""sd_notify datagrams and CurveZMQ key files (no model)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from common.keys import generate, read_key, read_public_keys
from common.notify import notify


def test_notify_sends_one_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert notify(ready=True, status="slots 0/4 busy\nserved 0")
        assert sock.recv(4096) == b"READY=1\nSTATUS=slots 0/4 busy served 0"


def test_notify_without_systemd_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify(ready=True) is False
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify.sock")
    assert notify(ready=True) is False


def test_key_pairs_round_trip(tmp_path: Path) -> None:
    key, pub = generate(tmp_path, "worker-a")
    assert key.stat().st_mode & 0o777 == 0o600
    assert read_key(key, secret=False) == read_key(pub, secret=False)
    assert len(read_key(key, secret=True)) == 40
    assert read_public_keys(tmp_path) == {read_key(pub, secret=False)}
    with pytest.raises(FileExistsError):
        generate(tmp_path, "worker-a")
    with pytest.raises(ValueError, match="holds no secret key"):
        read_key(pub, secret=True)
    with pytest.raises(ValueError, match=r"no \*\.pub files"):
        read_public_keys(tmp_path / "empty")
