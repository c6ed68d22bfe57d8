"""A worker's start record (common/start_record.py): a process that dies inside a start stage is counted by the next
start, with the signal it died of; after CRASH_LIMIT the start is refused with the reason and what to try; a Python
exception, a start still running, and another build or model do not count. Real child processes, no model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from common.start_record import ADVICE, CRASH_LIMIT, StartRecord, read_crash, read_refusal

CHILD = """
import os, signal, sys
from pathlib import Path
from common.start_record import StartRecord
record = StartRecord(Path(sys.argv[1]), sys.argv[2], *sys.argv[5:])
with record.stage(sys.argv[3]):
    if sys.argv[4] == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif sys.argv[4] == "raise":
        raise RuntimeError("a Python error, not a crash")
record.passed() if sys.argv[4] == "pass" else None
"""


def start(path: Path, identity: str, stage: str, what: str, *device: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", CHILD, str(path), identity, stage, what, *device]
    return subprocess.run(argv, capture_output=True, text=True)


def test_crashes_in_a_stage_are_counted_with_their_signal_and_the_limit_refuses_with_what_to_try(tmp_path):
    path = tmp_path / "w.start.json"
    record = StartRecord(path, "build-a")
    for n in range(1, CRASH_LIMIT + 1):
        child = start(path, "build-a", "first_decode", "segv")
        assert child.returncode == -signal.SIGSEGV
        assert read_crash(path, int(StartRecord(path, "build-a").read()["pid"])) == (
            "the worker's llama.cpp crashed (signal 11) in its first decode on this CPU"
        )
        assert record.crashes()[0] == n
        refusal = record.refusal()
        assert (refusal is None) == (n < CRASH_LIMIT)
    assert refusal is not None and "signal 11" in refusal and "first decode" in refusal and ADVICE in refusal
    assert read_refusal(path) == refusal  # what a supervisor reads


def test_a_crash_on_a_gpu_names_the_gpu_not_the_cpu(tmp_path):
    # (2026-11-28, an H200: the workers' crashes at load said "on this CPU")
    path = tmp_path / "w.start.json"
    child = start(path, "b", "load", "segv", "GPU 0")
    assert child.returncode == -signal.SIGSEGV
    expected = "the worker's llama.cpp crashed (signal 11) while loading the model on GPU 0"
    assert read_crash(path, int(StartRecord(path, "b").read()["pid"])) == expected  # the supervisor's reading
    assert StartRecord(path, "b", "GPU 0").crashes() == (1, expected)  # the next start's


def test_a_python_error_a_passing_start_and_another_build_do_not_count(tmp_path):
    path = tmp_path / "w.start.json"
    assert start(path, "b", "load", "segv").returncode == -signal.SIGSEGV
    assert start(path, "b", "load", "raise").returncode == 1
    assert StartRecord(path, "b").crashes()[0] == 1  # the SIGSEGV, not the exception
    assert StartRecord(path, "other-build").crashes() == (0, None)
    assert start(path, "b", "first_decode", "pass").returncode == 0
    assert not path.exists() and StartRecord(path, "b").refusal() is None


def test_a_start_that_is_still_running_is_not_a_crash(tmp_path):
    path = tmp_path / "w.start.json"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        path.write_text(f'{{"identity": "b", "pid": {sleeper.pid}, "stage": "load", "crashes": 0}}')
        assert StartRecord(path, "b").crashes()[0] == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    assert StartRecord(path, "b").crashes()[0] == 1
    assert os.getpid() != sleeper.pid
