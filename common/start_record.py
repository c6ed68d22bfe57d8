"""A worker's record of its own starts, read by its next start and by the supervisor that runs it.

A llama.cpp built for the wrong CPU (llama.cpp's AMX kernels on some Xeons: docs/setup.md, "The llama.cpp build") does not
fail a call: it kills the process with a signal at its first matrix product. A worker therefore loads its model and
decodes a few tokens (worker/startcheck.py) before it says hello, each stage inside `StartRecord.stage`.

A process cannot report its own SIGSEGV, so the start is recorded in a small file first (the stage, this start's
pid, and Python's fault handler writing the signal's name beside it). The next start of the same worker reads it:
the previous one died there. After CRASH_LIMIT such crashes with the same build and model, the worker refuses to
start (exit status START_FAILED_EXIT, which neither the router's supervisor nor the systemd unit restarts) and says
what happened and what to try. A new build or model file starts the count again; so does removing the file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from common import logs
from common.files import open_private, private_dir, runtime_base, write_private

log = logs.get(__name__)

START_FAILED_EXIT = 78  # EX_CONFIG: this machine cannot run this build; restarting will not change that
CRASH_LIMIT = 3
ADVICE = (
    "if other models run on this machine, this model file is the likely cause (llama.cpp aborts on a tensor or "
    "operation it cannot run: the worker's last log lines name it); else rebuild llama-cpp-python for this machine "
    "with ./scripts/setup (docs/setup.md, 'The llama.cpp build'); if that does not help, run `kvroute doctor` and paste its "
    "report into a bug report"
)
STAGES = {"load": "while loading the model", "first_decode": "in its first decode"}
FAULT_SIGNALS = {  # the first line Python's fault handler writes, per signal it catches
    "Segmentation fault": signal.SIGSEGV,
    "Bus error": signal.SIGBUS,
    "Illegal instruction": signal.SIGILL,
    "Floating-point exception": signal.SIGFPE,
    "Floating point exception": signal.SIGFPE,
    "Aborted": signal.SIGABRT,
}


def default_path(worker_id: str) -> Path:
    """Where a worker keeps its start record: systemd's RuntimeDirectory, else the user's runtime or temp directory,
    in a `kvroute` directory only this user can enter (common/files.py: checked when written and read)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in worker_id)
    return runtime_base() / f"worker-{safe}.start.json"


def crash_reason(stage: str, signum: int | None, device: str = "this CPU") -> str:
    what = f"signal {signum}" if signum else "it died without a word"
    return f"the worker's llama.cpp crashed ({what}) {STAGES.get(stage, 'at start')} on {device}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class StartRecord:
    path: Path
    identity: str  # the build and the model: crashes of another build or model do not count
    device: str = "this CPU"  # where the model runs, as the reason names it ("GPU 0")

    @property
    def fault_path(self) -> Path:
        return self.path.with_suffix(".fault")

    def read(self) -> dict[str, Any]:
        try:
            private_dir(self.path.parent)  # (another user's record would refuse this worker's starts)
            with os.fdopen(open_private(self.path, os.O_RDONLY)) as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("identity") == self.identity else {}

    def fault_signal(self) -> int | None:
        """The signal the previous start died of, as its fault handler wrote it (None when it wrote nothing)."""
        try:
            first = self.fault_path.read_text(errors="replace").strip().splitlines()[0]
        except (OSError, IndexError):
            return None
        for name, signum in FAULT_SIGNALS.items():
            if name in first:
                return int(signum)
        return None

    def fault_frames(self, n: int = 8) -> list[str]:
        """Where the previous start's crashing thread was, innermost first ("File ..., line N in f"), as its fault
        handler wrote it: a native crash then names the Python call that reached it."""
        try:
            text = self.fault_path.read_text(errors="replace")
        except OSError:
            return []
        _, current, rest = text.partition("Current thread")
        block = (rest if current else text).split("\n\n")[0]
        return [line.strip() for line in block.splitlines() if line.strip().startswith("File ")][:n]

    def crashes(self) -> tuple[int, str | None]:
        """Crashes at start so far (the previous start counted when it never finished), and the last one's reason."""
        data = self.read()
        count, reason = int(data.get("crashes", 0)), data.get("reason")
        stage, pid = data.get("stage"), int(data.get("pid", 0))
        if stage in STAGES and pid != os.getpid() and not _alive(pid):  # the previous start died in this stage
            count += 1
            reason = crash_reason(stage, self.fault_signal(), self.device)
        return count, reason

    def refusal(self) -> str | None:
        """Why this start should not even try (CRASH_LIMIT crashes at start with this build and model), else None."""
        count, reason = self.crashes()
        self._write(count, reason, stage=None)
        return refusal(count, reason)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Run a start stage with the record saying so; a crash inside leaves the record for the next start to read."""
        count, reason = self.crashes()
        self._write(count, reason, stage=name)
        fault: IO[str] | None = None
        with contextlib.suppress(OSError):
            fd = open_private(self.fault_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            fault = os.fdopen(fd, "w")  # (open for as long as the stage runs)
            faulthandler.enable(file=fault)
        try:
            yield
        finally:  # reached on a Python exception too: only a process killed inside the stage leaves it recorded
            if fault is not None:
                faulthandler.disable()
                fault.close()
                with contextlib.suppress(OSError):
                    self.fault_path.unlink()
            self._write(count, reason, stage=None)

    def refuse(self, reason: str) -> None:
        """This start cannot succeed for `reason` (its model does not load): the supervisor reads it (read_refusal)
        and does not restart the worker. The next start tries again (a file put right loads)."""
        count, last = self.crashes()
        self._write(count, last, stage=None, refused=reason)

    def passed(self) -> None:
        """The engine ran: crashes before this one no longer count."""
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _write(self, crashes: int, reason: str | None, stage: str | None, refused: str | None = None) -> None:
        data = {"identity": self.identity, "pid": os.getpid(), "stage": stage, "crashes": crashes, "reason": reason}
        data["device"] = self.device
        data["refused"] = refused or refusal(crashes, reason)
        try:
            private_dir(self.path.parent)
            write_private(self.path, json.dumps(data).encode())
        except OSError as exc:  # a read-only or foreign place only loses the count, never the start
            log.warning("start_record_unwritable", path=str(self.path), reason=str(exc))


def refusal(crashes: int, reason: str | None) -> str | None:
    if crashes < CRASH_LIMIT:
        return None
    return f"{reason or 'it crashed at start'} ({crashes} times), so it is not started again. What to try: {ADVICE}"


def read_refusal(path: Path) -> str | None:
    """For a supervisor: what the worker wrote when it refused to start (any identity)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("refused") if isinstance(data, dict) else None


def read_crash(path: Path, pid: int) -> str | None:
    """For a supervisor: the reason a start with this pid died at start (its record still names a stage), else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("pid") != pid or data.get("stage") not in STAGES:
        return None
    return crash_reason(str(data["stage"]), StartRecord(path, "").fault_signal(), str(data.get("device", "this CPU")))
