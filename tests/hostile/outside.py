"""Clients in a process of their own (as an attacker and its neighbours are): one request sent `times` at once while
`/health` is polled, and, with CHATS > 0, that many one-token chats before it (the normal load) and as many while it is
served. Prints what it saw as JSON: each answer's status, the slowest `/health`, the chats' median times and whether
the request was still being served when the last chat during it ended. Its clients take no turns of the server
process's GIL, so what it measures is the server's.

    python tests/hostile/outside.py URL PATH BODY_FILE TIMES HEADERS_JSON KEY CHATS
"""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import sys
import threading
import time

import httpx

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def main() -> None:
    url, path, body_file, times, headers, key, chats = sys.argv[1:8]
    body = open(body_file, "rb").read()  # noqa: SIM115
    auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    sent = {**auth, **json.loads(headers)}
    waits: list[float] = []
    done = threading.Event()

    def chat_s(client: httpx.Client) -> float:
        t0 = time.monotonic()
        r = client.post(f"{url}/v1/chat/completions", json=CHAT, headers=auth)
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                client.get(f"{url}/health")
                waits.append(time.monotonic() - t0)
                time.sleep(0.02)

    def post(_: int) -> int:
        return httpx.post(f"{url}{path}", content=body, headers=sent, timeout=300).status_code

    seen: dict[str, object] = {}
    with httpx.Client(timeout=60) as client:
        if int(chats):
            seen["chat_before_s"] = statistics.median(chat_s(client) for _ in range(int(chats)))
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(int(times)) as pool:
            answers = [pool.submit(post, i) for i in range(int(times))]
            if int(chats):
                time.sleep(0.3)
                seen["chat_during_s"] = statistics.median(chat_s(client) for _ in range(int(chats)))
                seen["outlasted_chats"] = not all(a.done() for a in answers)
            statuses = [a.result() for a in answers]
    done.set()
    poller.join(30)
    ranked = sorted(waits)
    p99 = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]
    print(json.dumps({"statuses": statuses, "health_max_s": ranked[-1], "health_p99_s": p99, "health_polls": len(waits), **seen}))


if __name__ == "__main__":
    main()
