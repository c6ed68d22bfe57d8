"""A worker whose llama.cpp crashes at start (a real SIGSEGV in its first decode, KVROUTE_FAULTS=segv:first-decode, as
a build with AMX kernels does on some Xeons) on a real `kvroute serve`: it is restarted a few times, then not again;
/health, `kvroute status` and the requests left without a worker say what happened and what to try; a healthy
worker beside it keeps serving. And `kvroute doctor`: its smoke test passes here, and reports such a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fault_helpers import BOUND_S, Served, status, wait_for

from common.start_record import ADVICE, CRASH_LIMIT

pytestmark = pytest.mark.model

FLAGS = ("--slots", "1", "--ctx-per-slot", "512", "--threads", "1", "--restart-backoff-s", "0.2")
CRASH = "the worker's llama.cpp crashed (signal 11) in its first decode on this CPU"


def health(served: Served) -> httpx.Response:
    return httpx.get(f"{served.url}/health", timeout=10)


def test_a_worker_crashing_at_start_stops_after_the_limit_and_the_other_worker_serves(tmp_path):
    served = Served(*FLAGS, "--workers", "2", log=tmp_path / "serve.log", env={"KVROUTE_FAULTS": "segv:first-decode@cpu1"})
    try:
        st = wait_for(lambda: s if (s := status(served.zmq)).failed else None, BOUND_S, "cpu1 given up")
        assert [f.worker for f in st.failed] == ["cpu1"]
        assert CRASH in st.failed[0].reason and ADVICE in st.failed[0].reason
        assert [w.worker for w in st.workers] == ["cpu0"]
        # (/health's view of the router is up to a second old)
        h = wait_for(lambda: r if "failed" in (r := health(served)).json() else None, 5, "/health names cpu1")
        assert h.status_code == 200 and h.json()["failed"]["cpu1"] == st.failed[0].reason
        chat = {"messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 4}
        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=BOUND_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        shown = subprocess.run([sys.executable, "-m", "commands.cli", "status", "--connect", served.zmq],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert f"FAILED worker cpu1: {CRASH}" in shown.stdout
    finally:
        served.stop()
    events = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("{")]
    crashed = [e for e in events if e.get("event") == "worker_crashed_at_start"]
    assert len(crashed) == CRASH_LIMIT and all(e["worker"] == "cpu1" and e["returncode"] == -11 for e in crashed)
    assert sum(e.get("event") == "worker_spawned" and e.get("worker") == "cpu1" for e in events) == CRASH_LIMIT + 1
    # each start after a crash names the Python call the crash happened under (the fault handler's dump)
    previous = [e for e in events if e.get("event") == "previous_start_crashed"]
    assert len(previous) == CRASH_LIMIT and all(e["process"] == "worker-cpu1" for e in previous)
    assert all("faults.py" in e["python_stack"][0] and "at_start" in e["python_stack"][0] for e in previous)


def test_with_no_worker_left_health_and_requests_get_the_reason(tmp_path):
    served = Served(*FLAGS, "--workers", "1", wait_ready=False, log=tmp_path / "serve.log",
                    env={"KVROUTE_FAULTS": "segv:first-decode"})  # fmt: skip
    try:
        served.wait_health(503, timeout_s=BOUND_S)
        h = wait_for(lambda: r if (r := health(served)).json().get("status") == "failed" else None, BOUND_S, "/health failed")
        assert h.status_code == 503 and CRASH in h.json()["reason"] and ADVICE in h.json()["reason"]
        chat = {"messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 4}
        r = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=BOUND_S)
        assert r.status_code == 503
        assert CRASH in r.json()["error"]["message"] and ADVICE in r.json()["error"]["message"]
        assert served.proc.poll() is None  # the server stays up to say so
    finally:
        served.stop()


def doctor(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commands.cli", "doctor", "--json", "--threads", "2"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})  # fmt: skip


def test_doctor_reports_this_machine_and_its_smoke_test_passes():
    out = doctor()
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["smoke"]["ok"] and len(report["smoke"]["tokens"]) == 4
    assert report["llama"]["build_matches"] and not report["llama"]["amx_compiled_in"]
    assert "AVX" in report["llama"]["system_info"] and report["cpu"]["machine"]
    assert Path(report["model"]["path"]).is_file() and len(report["model"]["sha256"]) == 64
    assert report["memory"]["MemAvailable"] > 0 and report["python"].startswith(sys.version.split()[0])


def test_doctor_reports_a_crash_in_its_smoke_test_instead_of_suffering_it():
    out = doctor({"KVROUTE_FAULTS": "segv:first-decode"})
    assert out.returncode == 1
    smoke = json.loads(out.stdout)["smoke"]
    assert not smoke["ok"] and "signal 11" in smoke["error"] and ADVICE in smoke["error"]
