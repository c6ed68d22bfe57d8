"""A deployment in miniature, with the real model: two `kvroute router` processes side by side with CURVE on both
sockets and two real `kvroute worker` processes (2 slots, 1 thread each) reporting to both, each worker in its own
network namespace joined to the routers by a veth pair in a private test subnet, all started with NOTIFY_SOCKET like
systemd does.
Where `kubectl` is installed, the router and the workers are started with the arguments, environment and settings
file that deploy/kubernetes gives them (its cpu overlay), their paths and endpoints mapped to this test's and the
sizes cut to fit, so that the manifests run what is tested here.

One set of processes serves every test here: READY/STATUS notifications, workers in namespaces reaching
the router over TCP, CURVE (allowed worker and client in; wrong key and no key out), and last, SIGTERM
draining one worker while 4 requests stream. Where namespaces cannot be created (checked by trying) the
same processes run on loopback and only the namespace test is skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from bench.systems import free_port
from common.keys import generate, read_key
from common.model import cache_dir, resolve_model
from common.socket_security import secure_client_socket
from common.vocab import Vocab
from protocol import (
    Delta,
    Hello,
    Invalid,
    Result,
    Sampling,
    StatusReply,
    StatusRequest,
    Submit,
    encode,
    router_reply_decoder,
)

pytestmark = pytest.mark.model

KVROUTE = str(Path(sys.executable).parent / "kvroute")
KUBE_OVERLAY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "overlays" / "cpu"
ROUTER_SIZES = ["--busy-wait-ms", "0", "--hold-ms", "0"]
WORKER_SIZES = ["--slots", "2", "--ctx-per-slot", "512", "--threads", "1", "--drain-timeout-s", "60"]
# the workers' [worker] connect in the manifests: both routers, side by side
ROUTERS_IN_MANIFESTS = "tcp://kvroute-router-0.kvroute-router-headless:5556,tcp://kvroute-router-1.kvroute-router-headless:5556"
SUBNET = "10.231"  # 10.231.1.0/24 for namespace a, 10.231.2.0/24 for namespace b; checked unused first


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


class Namespaces:
    """Two network namespaces, each with a veth pair to the root namespace; removed by `close()`."""

    def __init__(self) -> None:
        tag = f"kvr{os.getpid()}"  # pids fit: kvr + 7 digits + a0 is within the 15-character link name limit
        self.names = [f"{tag}a", f"{tag}b"]
        self.links = [f"{tag}a0", f"{tag}b0"]
        self.router_addr = f"{SUBNET}.1.1"  # the root end of namespace a's veth: the router binds here

    def create(self) -> None:
        self.remove_stale()
        routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
        addrs = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        if f" {SUBNET}." in routes + addrs or f"\n{SUBNET}." in routes:
            raise RuntimeError(f"{SUBNET}.0.0/16 is already in use on this host")
        for i, (ns, link) in enumerate(zip(self.names, self.links, strict=True), start=1):
            inner = link[:-1] + "1"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", link, "type", "veth", "peer", "name", inner)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "addr", "add", f"{SUBNET}.{i}.1/24", "dev", link)
            sh("ip", "link", "set", link, "up")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", inner)
            sh("ip", "-n", ns, "link", "set", inner, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # only the test subnet is reachable from inside: no default route
            sh("ip", "-n", ns, "route", "add", f"{SUBNET}.0.0/16", "via", f"{SUBNET}.{i}.1")

    def close(self) -> None:
        for ns, link in zip(self.names, self.links, strict=True):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    @staticmethod
    def remove_stale() -> None:
        """Namespaces left by a test run that was killed before its clean-up (its pid is gone)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for name in listed:
            m = re.fullmatch(r"kvr(\d+)[ab]", name)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                subprocess.run(["ip", "link", "del", name + "0"], capture_output=True)
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NotifyListener:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET; a thread keeps every datagram."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            self.seen.extend(self.sock.recv(65536).decode().splitlines())

    def lines(self) -> list[str]:
        return list(self.seen)

    def wait_for(self, prefix: str, timeout_s: float, proc: subprocess.Popen[Any] | None = None) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = [line for line in self.lines() if line.startswith(prefix)]
            if hit:
                return hit[-1]
            assert proc is None or proc.poll() is None, f"process exited with {proc.returncode} before {prefix}"
            time.sleep(0.05)
        raise AssertionError(f"no {prefix!r} on {self.path} in {timeout_s} s; seen {self.seen[-5:]}")


class Peer:
    """A DEALER speaking to the router, with CURVE keys or without."""

    def __init__(self, endpoint: str, *, key: Path | None = None, router_pub: Path | None = None, identity: str = "") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)  # a DEALER whose handshake was refused has no pipe: send would block
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        secure_client_socket(self.sock, str(key) if key else None, str(router_pub) if router_pub else None)
        self.sock.connect(endpoint)
        self.replies = router_reply_decoder()

    def send(self, msg: Any, refused_ok: bool = False) -> None:
        """Send; with `refused_ok` a send that finds no connection (the router refused us) is not an error."""
        try:
            self.sock.send(encode(msg))
        except zmq.Again:
            assert refused_ok, "no connection to the router in 5 s"

    def recv(self, timeout_s: float) -> Any | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        msg = self.replies.decode(self.sock.recv())
        assert not isinstance(msg, Invalid), msg
        return msg

    def status(self) -> StatusReply:
        self.send(StatusRequest(id="st"))
        while True:
            msg = self.recv(10)
            assert msg is not None, "no status reply in 10 s"
            if isinstance(msg, StatusReply):
                return msg

    def close(self) -> None:
        self.sock.close(0)


@dataclass
class Cluster:
    tmp: Path
    netns: Namespaces | None
    no_netns_reason: str
    client_ep: str
    worker_ep: str
    client_ep2: str  # the second router's (routers side by side, as the manifests run two)
    worker_ep2: str
    keys: dict[str, Path]
    manifests: Manifests | None = None  # what the router and workers were started with (None: this test's own flags)
    router: subprocess.Popen[bytes] | None = None
    router2: subprocess.Popen[bytes] | None = None
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    notify: dict[str, NotifyListener] = field(default_factory=dict)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def client(self) -> Peer:
        return Peer(self.client_ep, key=self.keys["client.key"], router_pub=self.keys["router.pub"])

    def start(self, name: str, cmd: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self.notify[name] = NotifyListener(self.tmp / f"{name}.notify")
        env = {**os.environ, "KVROUTE_LOG_FORMAT": "json", **(env_extra or {}), "NOTIFY_SOCKET": self.notify[name].path}
        with open(self.tmp / f"{name}.log", "wb") as log:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)


@dataclass
class Manifests:
    """The router's and the workers' containers as deploy/kubernetes runs them: arguments, plain environment, and
    the settings file of its ConfigMap."""

    router: list[str]
    worker: list[str]
    env: dict[str, str]
    settings: dict[str, Any]
    gateway: list[str]  # the gateway's arguments (its clients' side is this test's own)

    @classmethod
    def read(cls) -> Manifests | None:
        if shutil.which("kubectl") is None:
            return None
        out = subprocess.run(["kubectl", "kustomize", str(KUBE_OVERLAY)], capture_output=True, text=True, timeout=60, check=True)
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        containers = {
            d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0] for d in docs if "template" in d.get("spec", {})
        }
        router, worker = containers["kvroute-router"], containers["kvroute-worker"]
        env = {e["name"]: e["value"] for c in (router, worker) for e in c.get("env", []) if "value" in e}
        (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
        settings = tomllib.loads(config["data"]["kvroute.toml"])
        return cls(router["args"], worker["args"], env, settings, containers["kvroute-gateway"]["args"])

    def command(self, args: list[str], paths: dict[str, str]) -> list[str]:
        """The container's arguments with this test's paths: every absolute path and $(VAR) must have one."""
        out = []
        for a in args:
            if a.startswith("/") or a.startswith("$("):
                assert a in paths, f"the manifests use {a}, which this test does not provide"
                a = paths[a]
            out.append(a)
        return [KVROUTE, *out]

    def write_settings(self, path: Path, values: dict[str, str]) -> None:
        """The ConfigMap's settings file with this test's paths and endpoints (each one must have a value here)."""
        lines = []
        for table, settings in self.settings.items():
            lines.append(f"[{table}]")
            for key, value in settings.items():
                if isinstance(value, str) and (value.startswith("/") or "://" in value):
                    assert value in values, f"the manifests' [{table}] {key} = {value!r} has no value in this test"
                    value = values[value]
                lines.append(f"{key} = {json.dumps(value)}")
        path.write_text("\n".join(lines) + "\n")


def make_keys(tmp: Path) -> dict[str, Path]:
    keys: dict[str, Path] = {}
    for name, where in (("router", "router"), ("wa", "workers"), ("wb", "workers"), ("client", "clients"), ("intruder", "x")):
        key, pub = generate(tmp / where, name)
        keys[f"{name}.key"], keys[f"{name}.pub"] = key, pub
    return keys


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    netns: Namespaces | None = Namespaces()
    reason = ""
    if shutil.which("ip") is None:
        netns, reason = None, "the `ip` command is not installed"
    else:
        assert netns is not None
        try:
            netns.create()
        except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
            detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            netns.close()
            netns, reason = None, f"network namespaces cannot be created here: {detail}"
    host = netns.router_addr if netns else "127.0.0.1"
    c = Cluster(
        tmp, netns, reason, f"tcp://127.0.0.1:{free_port()}", f"tcp://{host}:{free_port()}",
        f"tcp://127.0.0.1:{free_port()}", f"tcp://{host}:{free_port()}", make_keys(tmp),
    )  # fmt: skip
    second = ["--zmq", c.client_ep2, "--worker-endpoint", c.worker_ep2]  # (its flags win over the settings file)
    c.manifests = m = Manifests.read()
    env: dict[str, str] = {}  # (the manifests' environment, when they are used)
    try:
        if m is not None:  # as deploy/kubernetes starts them
            values = {
                "tcp://0.0.0.0:5555": c.client_ep, "tcp://0.0.0.0:5556": c.worker_ep,
                ROUTERS_IN_MANIFESTS: f"{c.worker_ep},{c.worker_ep2}",
                "/etc/kvroute/keys/router.key": str(c.keys["router.key"]),
                "/etc/kvroute/workers": str(tmp / "workers"), "/etc/kvroute/clients": str(tmp / "clients"),
                "/etc/kvroute/keys/router.pub": str(c.keys["router.pub"]),
                "/etc/kvroute/keys/worker.key": str(c.keys["wa.key"]),  # (each worker's own --curve-key wins)
            }  # fmt: skip
            m.write_settings(tmp / "kvroute.toml", values)
            env = {k: str(cache_dir()) if v == "/var/cache/kvroute" else v for k, v in m.env.items()}
            paths = {"/etc/kvroute/kvroute.toml": str(tmp / "kvroute.toml"), "/tmp/alive": str(tmp / "alive-router")}
            c.router = c.start("router", [*m.command(m.router, paths), *ROUTER_SIZES], env)
            paths2 = {**paths, "/tmp/alive": str(tmp / "alive-router2")}
            c.router2 = c.start("router2", [*m.command(m.router, paths2), *ROUTER_SIZES, *second], env)
        else:
            own_router = [
                KVROUTE, "router", "--zmq", c.client_ep, "--worker-endpoint", c.worker_ep,
                "--curve-key", str(c.keys["router.key"]), "--worker-keys", str(tmp / "workers"),
                "--client-keys", str(tmp / "clients"), *ROUTER_SIZES,
            ]  # fmt: skip
            c.router = c.start("router", own_router)
            c.router2 = c.start("router2", [*own_router, *second])
        c.notify["router"].wait_for("READY=1", 60, c.router)
        c.notify["router2"].wait_for("READY=1", 60, c.router2)
        for i, wid in enumerate(("wa", "wb")):
            prefix = ["ip", "netns", "exec", netns.names[i]] if netns else []
            own = ["--curve-key", str(c.keys[f"{wid}.key"])]
            if m is not None:
                paths = {
                    "/etc/kvroute/kvroute.toml": str(tmp / "kvroute.toml"), "$(POD_NAME)": wid,
                    "/var/cache/kvroute/disk": str(tmp / f"disk-{wid}"), "/tmp/alive": str(tmp / f"alive-{wid}"),
                }  # fmt: skip
                c.workers[wid] = c.start(wid, [*prefix, *m.command(m.worker, paths), *own, *WORKER_SIZES], env)
            else:
                c.workers[wid] = c.start(
                    wid,
                    [
                        *prefix, KVROUTE, "worker", "--connect", f"{c.worker_ep},{c.worker_ep2}", "--worker-id", wid,
                        "--router-key", str(c.keys["router.pub"]), *own, *WORKER_SIZES,
                    ],
                )  # fmt: skip
        for wid, proc in c.workers.items():
            c.notify[wid].wait_for("READY=1", 180, proc)
        yield c
    finally:
        routers = [r for r in (c.router, c.router2) if r is not None]
        for proc in [*c.workers.values(), *routers]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*c.workers.values(), *routers]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if netns is not None:
            netns.close()


def submit_all(peer: Peer, ids: list[str], max_tokens: int, stream: bool = False) -> None:
    for i, rid in enumerate(ids):
        prompt = f"Item {i}: the {['sea', 'sky', 'road', 'tree', 'lamp', 'door'][i % 6]} is"
        peer.send(Submit(id=rid, prompt=prompt, sampling=Sampling(max_tokens=max_tokens, temperature=0.0), stream=stream))


def collect(peer: Peer, ids: list[str], timeout_s: float = 120, on_delta: Any = None) -> dict[str, Any]:
    """Each request's final message (Result or Error); fails if any does not end in time."""
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(ids):
        msg = peer.recv(max(0.1, deadline - time.monotonic()))
        assert msg is not None, f"requests {set(ids) - set(out)} did not end in {timeout_s} s"
        if isinstance(msg, Delta):
            if on_delta is not None:
                on_delta(msg)
        elif getattr(msg, "id", None) in ids:
            out[msg.id] = msg
    return out


def test_router_and_workers_send_ready_and_status(cluster: Cluster) -> None:
    for router in ("router", "router2"):  # both routers side by side: each has both workers
        assert cluster.notify[router].wait_for("STATUS=", 5).startswith("STATUS=workers")
        status = cluster.notify[router].wait_for("STATUS=workers 2 ready/2", 10)
        assert "slots " in status and "/4 busy" in status and "served " in status
    for wid in ("wa", "wb"):
        line = cluster.notify[wid].wait_for("STATUS=slots", 10)
        assert "/2 busy" in line and "jobs done" in line
        assert '"event": "accepted"' in cluster.log(wid)


def test_the_processes_ran_as_the_kubernetes_manifests_start_them(cluster: Cluster) -> None:
    if cluster.manifests is None:
        pytest.skip("kubectl is not installed: the processes ran with this test's own flags")
    # the liveness probes' files (--alive-file), touched by the router's loop and by each idle or stepping engine
    for name in ("router", "router2", "wa", "wb"):
        alive = cluster.tmp / f"alive-{name}"
        assert alive.exists() and time.time() - alive.stat().st_mtime < 30, name
    for wid in ("wa", "wb"):  # each worker's disk tier in its own volume (--cache-dir)
        assert (cluster.tmp / f"disk-{wid}").is_dir()


def test_workers_in_namespaces_reach_the_router_over_tcp(cluster: Cluster) -> None:
    if cluster.netns is None:
        pytest.skip(cluster.no_netns_reason)
    for wid, ns in zip(("wa", "wb"), cluster.netns.names, strict=True):
        pid = cluster.workers[wid].pid
        assert subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip() == ns
        conns = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tnH", "state", "established"], capture_output=True, text=True)
        assert cluster.worker_ep.removeprefix("tcp://") in conns.stdout, conns.stdout  # its TCP goes over the veth
    peer = cluster.client()
    ids = [f"ns{i}" for i in range(4)]
    submit_all(peer, ids, max_tokens=4)
    results = collect(peer, ids)
    assert all(isinstance(r, Result) and r.usage.completion_tokens > 0 for r in results.values()), results
    assert {r.worker for r in results.values()} == {"wa", "wb"}  # both namespaces served
    peer.close()


def test_curve_lets_allowed_keys_in_and_keeps_others_out(cluster: Cluster) -> None:
    # the two real workers got in with their allowed keys (READY=1 comes only after Accept)
    ok = cluster.client()
    assert {w.worker for w in ok.status().workers} == {"wa", "wb"}
    ok.close()
    # Who must get no answer is asked at once, and each silence waited for side by side (from its own send): a worker
    # with a key the router does not know (logged), clients with no key at all or a key not allowed, the CLI without keys
    cli = [sys.executable, "-m", "commands.cli", "status", "--connect", cluster.client_ep, "--timeout", "3"]
    without = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fingerprint = Vocab.load(resolve_model(None)).fingerprint
    intruder = Peer(cluster.worker_ep, key=cluster.keys["intruder.key"], router_pub=cluster.keys["router.pub"], identity="evil")
    hello = Hello(worker_id="evil", incarnation=1, slots=2, ctx_per_slot=512, model_fingerprint=fingerprint, device="cpu")
    intruder.send(hello, refused_ok=True)
    wrong = {"key": cluster.keys["intruder.key"], "router_pub": cluster.keys["router.pub"]}
    peers = [Peer(cluster.client_ep), Peer(cluster.client_ep, **wrong)]
    for peer in peers:
        peer.send(Submit(id="nokey", prompt="Hello", sampling=Sampling(max_tokens=2)), refused_ok=True)
    sent = time.monotonic()
    # meanwhile the CLI with the allowed client key gets in
    keys = ["--curve-key", str(cluster.keys["client.key"]), "--router-key", str(cluster.keys["router.pub"])]
    with_keys = subprocess.run([*cli, *keys], capture_output=True, text=True, timeout=60)
    assert with_keys.returncode == 0 and "wa" in with_keys.stdout, with_keys.stderr
    for peer in peers:
        assert peer.recv(max(0.0, sent + 2 - time.monotonic())) is None
        peer.close()
    assert intruder.sock.poll(max(0, int((sent + 3 - time.monotonic()) * 1000))) == 0
    intruder.close()
    _, err = without.communicate(timeout=60)
    assert without.returncode == 1 and "cannot reach the router" in err
    ok = cluster.client()
    assert {w.worker for w in ok.status().workers} == {"wa", "wb"}  # "evil" never joined
    ok.close()
    log = cluster.log("router")
    refused = [line for line in log.splitlines() if '"peer_refused"' in line]
    intruder_key = read_key(cluster.keys["intruder.pub"], secret=False).decode()
    for sock in ("workers", "clients"):
        assert any(f'"socket": "{sock}"' in line and intruder_key in line for line in refused), refused
    assert any('"handshake_failed"' in line and '"socket": "clients"' in line for line in log.splitlines())  # the keyless one


def test_sigterm_drains_a_worker_while_4_requests_stream(cluster: Cluster) -> None:
    peer = cluster.client()
    ids = [f"d{i}" for i in range(4)]
    started: set[str] = set()
    submit_all(peer, ids, max_tokens=48, stream=True)
    deadline = time.monotonic() + 120
    while len(started) < 4:  # every request is streaming
        msg = peer.recv(max(0.1, deadline - time.monotonic()))
        assert msg is not None and isinstance(msg, Delta), msg
        started.add(msg.id)
    busy = {w.worker: sum(s.busy for s in w.slots) for w in peer.status().workers}
    assert busy == {"wa": 2, "wb": 2}, busy
    victim = cluster.workers["wa"]
    victim.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while next(w.state for w in peer.status().workers if w.worker == "wa") != "draining":
        assert time.monotonic() - t0 < 2, "the router did not mark the worker draining within 2 s"
        time.sleep(0.05)
    later = ["after0", "after1"]
    submit_all(peer, later, max_tokens=4)
    results = collect(peer, ids + later)
    for rid in ids:
        r = results[rid]
        assert isinstance(r, Result) and r.finish_reason == "length" and r.usage.completion_tokens == 48, r
    assert {results[rid].worker for rid in ids} == {"wa", "wb"}
    assert all(isinstance(results[rid], Result) and results[rid].worker == "wb" for rid in later), results
    assert victim.wait(60) == 0
    assert cluster.notify["wa"].wait_for("STOPPING=1", 1)
    peer.close()


def test_workers_in_namespaces_stream_straight_to_a_client_with_curve(cluster: Cluster) -> None:
    """Direct replies (PROTOCOL.md 4.4) as a gateway pod gets them: the client's reply endpoint on its own address
    (the manifests give the gateway `--reply-endpoint tcp://$(POD_IP):*`), CURVE on it, the workers in their
    namespaces connecting to it over TCP; the router only places the requests."""
    import asyncio

    from kvroute.client import AsyncClient

    host = cluster.netns.router_addr if cluster.netns else "127.0.0.1"
    if cluster.manifests is not None:
        gateway = cluster.manifests.gateway
        assert "--reply-endpoint" in gateway and gateway[gateway.index("--reply-endpoint") + 1] == "tcp://$(POD_IP):*"

    async def run() -> tuple[list[Result], str, str]:
        client = AsyncClient(
            cluster.client_ep,
            curve_key=str(cluster.keys["client.key"]),
            router_key=str(cluster.keys["router.pub"]),
            reply_endpoint=f"tcp://{host}:*",
            timeout_s=120,
        )
        asks = [client.submit(prompt=f"Item {i}: the sea is", max_tokens=6, temperature=0.0) for i in range(4)]
        results = await asyncio.gather(*asks)
        assert client._direct is not None and not client._direct.broken
        endpoint, key = client._direct.endpoint, client._direct.key
        metrics = await client.metrics()
        await client.close()
        return list(results), f"{endpoint} {key}", metrics

    results, reply, metrics = asyncio.run(run())
    assert reply.startswith(f"tcp://{host}:") and len(reply.split()[1]) == 40  # bound there, with a CURVE key
    assert all(r.usage.completion_tokens == 6 for r in results)
    direct = sum(float(v) for v in re.findall(r"^kvroute_direct_jobs_total (\S+)$", metrics, re.M))
    assert direct >= 4
    for wid in {r.worker for r in results}:  # (the router places them where it likes: one worker or both)
        assert '"event": "reply_endpoint_opened"' in cluster.log(wid) and '"curve": true' in cluster.log(wid)
