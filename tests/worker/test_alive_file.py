"""--alive-file: where there is no systemd watchdog (Kubernetes), a file touched while the engine is idle or making
progress, and left alone while a job runs and the engine is stuck, so that a liveness probe restarts a hung worker."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import zmq

from worker.config import WorkerConfig
from worker.main import WorkerServer


def test_the_alive_file_is_touched_only_while_the_engine_moves(tmp_path: Path) -> None:
    alive = tmp_path / "alive"
    engine = SimpleNamespace(vocab=SimpleNamespace(path="/nonexistent.gguf"), after_step=None, progress=0, working=lambda: False)
    server = WorkerServer(WorkerConfig(model="/nonexistent.gguf", alive_file=str(alive)), engine, zmq.Context())  # type: ignore[arg-type]
    try:
        server.watchdog()  # idle
        assert alive.exists()
        os.utime(alive, (1, 1))
        engine.working = lambda: True
        engine.progress = 1
        server.watchdog()  # working and stepping
        assert alive.stat().st_mtime > 1
        os.utime(alive, (1, 1))
        server.watchdog()  # working, no step since the last look: stuck
        assert alive.stat().st_mtime == 1
    finally:
        server.pull.close(0)
        server.zctx.destroy(linger=0)
