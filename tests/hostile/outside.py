"""A hostile client in a process of its own (as an attacker is): sends one request `times` at once while polling
`/health`; prints `sending` as it sends, then what it saw as JSON (each answer's status, the slowest `/health`). Its
reading of the answers then takes no turns of the server process's GIL, so the `/health` times are the server's.

    python tests/hostile/outside.py URL PATH BODY_FILE TIMES HEADERS_JSON KEY
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time

import httpx


def main() -> None:
    url, path, body_file, times, headers, key = sys.argv[1:7]
    body = open(body_file, "rb").read()  # noqa: SIM115
    sent = {"Authorization": f"Bearer {key}", "content-type": "application/json", **json.loads(headers)}
    waits: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                client.get(f"{url}/health")
                waits.append(time.monotonic() - t0)
                time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.2)

    def post(_: int) -> int:
        return httpx.post(f"{url}{path}", content=body, headers=sent, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(int(times)) as pool:
        print("sending", flush=True)
        statuses = list(pool.map(post, range(int(times))))
    done.set()
    poller.join(30)
    print(json.dumps({"statuses": statuses, "health_max_s": max(waits), "health_polls": len(waits)}))


if __name__ == "__main__":
    main()
