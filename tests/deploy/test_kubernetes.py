"""deploy/kubernetes renders (`kubectl kustomize`), every object is valid for Kubernetes 1.32 (kubernetes-validate,
its schemas offline; the ServiceMonitor, a CRD, by hand), and the manifests run what kvroute takes: each container's
arguments, with the settings file of the ConfigMap, parse into the same config objects the processes build; every
file a flag names is mounted; Services, probes, disruption budgets and the ServiceMonitor find what they name; and
the Secret the manifests read holds exactly the keys deploy/README.md tells the operator to put in it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from commands.cli import build_parser
from common.config import from_args, load_config_file
from gateway.server import HttpConfig
from router.config import RouterConfig
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.32.0"
ROUTERS = 2  # side by side over the fleet
CONFIGS = {"router": RouterConfig, "worker": WorkerConfig, "http": HttpConfig}
FILE_FLAGS = ("--config", "--curve-key", "--router-key", "--alive-file", "--cache-dir")
FILE_SETTINGS = ("curve_key", "router_key", "worker_keys", "client_keys")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed")


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_object_is_valid_for_kubernetes(objects) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in kubernetes-validate (checked below)
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_each_container_runs_flags_kvroute_takes_with_the_configmaps_settings(objects, tmp_path) -> None:
    toml = tmp_path / "kvroute.toml"
    toml.write_text(of_kind(objects, "ConfigMap")[0]["data"]["kvroute.toml"])
    parser, _, subs = build_parser()
    seen = set()
    for w in workloads(objects):
        (c,) = w["spec"]["template"]["spec"]["containers"]
        fields = {e["name"] for e in c.get("env", []) if "fieldRef" in e.get("valueFrom", {})}  # POD_NAME
        args = [re.sub(r"\$\((\w+)\)", lambda m, fields=fields: "kvroute-worker-0" if m.group(1) in fields else m.group(0), a)
                for a in c["args"]]  # fmt: skip
        command = args[0]
        if "--config" in args:
            args[args.index("--config") + 1] = str(toml)
            subs[command].set_defaults(**load_config_file(str(toml), command, subs[command]))
        cfg = from_args(CONFIGS[command], parser.parse_args(args))  # the checks a start makes on its settings
        seen.add(command)
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        files = [args[args.index(f) + 1] for f in FILE_FLAGS if f in args]
        files += [getattr(cfg, s) for s in FILE_SETTINGS if getattr(cfg, s, None)]
        for path in files:
            path = "/etc/kvroute/kvroute.toml" if path == str(toml) else path
            assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), f"{command}: {path} not mounted"
        routers = [f"tcp://kvroute-router-{i}.kvroute-router-headless:{{}}" for i in range(ROUTERS)]
        if command == "worker":  # every worker reports to every router (side by side)
            assert cfg.worker_id == "kvroute-worker-0" and cfg.connect == ",".join(r.format(5556) for r in routers)
        if command == "http":
            assert cfg.router == ",".join(r.format(5555) for r in routers)
    assert seen == set(CONFIGS)


def test_services_probes_and_budgets_find_what_they_name(objects) -> None:
    pods = {w["metadata"]["name"]: w["spec"]["template"] for w in workloads(objects)}
    ports = {
        name: {p["name"]: p["containerPort"] for p in t["spec"]["containers"][0].get("ports", [])} for name, t in pods.items()
    }
    for svc in of_kind(objects, "Service"):
        chosen = [n for n, t in pods.items() if matches(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert len(chosen) == 1, f"Service {svc['metadata']['name']} selects {chosen}"
        for p in svc["spec"].get("ports", []):
            assert p["targetPort"] in ports[chosen[0]], f"Service {svc['metadata']['name']}: no port {p['targetPort']}"
    router = named(objects, "Service", "kvroute-router")
    assert {p["name"]: p["port"] for p in router["spec"]["ports"]} == {"clients": 5555, "workers": 5556}
    routers = named(objects, "StatefulSet", "kvroute-router")
    assert routers["spec"]["replicas"] == ROUTERS and routers["spec"]["serviceName"] == "kvroute-router-headless"
    assert named(objects, "Service", "kvroute-router-headless")["spec"]["clusterIP"] == "None"
    for name, t in pods.items():
        c = t["spec"]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c.get(probe, {}).get("tcpSocket", c.get(probe, {}).get("httpGet", {})).get("port")
            assert port is None or port in ports[name], f"{name} {probe}: no port {port}"
        assert "livenessProbe" in c, f"{name} has no liveness probe"
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        chosen = [n for n, t in pods.items() if matches(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])]
        assert len(chosen) == 1
    (monitor,) = of_kind(objects, "ServiceMonitor")
    (svc,) = [
        s for s in of_kind(objects, "Service") if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}


def test_workers_drain_within_their_grace_period(objects, tmp_path) -> None:
    toml = tmp_path / "kvroute.toml"
    toml.write_text(of_kind(objects, "ConfigMap")[0]["data"]["kvroute.toml"])
    _, _, subs = build_parser()
    for command, name, writes_s in (("worker", "kvroute-worker", 30), ("router", "kvroute-router", 0)):
        settings = load_config_file(str(toml), command, subs[command])
        (w,) = [o for o in workloads(objects) if o["metadata"]["name"] == name]
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert settings["drain_timeout_s"] + writes_s < grace


def test_gpu_workers_take_one_gpu_each_and_cpu_workers_threads_match_their_cores() -> None:
    gpu = named(render("gpu"), "StatefulSet", "kvroute-worker")["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["args"][gpu["args"].index("--gpu") + 1] == "0"
    cpu = named(render("cpu"), "StatefulSet", "kvroute-worker")["spec"]["template"]["spec"]["containers"][0]
    assert "--gpu" not in cpu["args"] and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert cpu["args"][cpu["args"].index("--threads") + 1] == cpu["resources"]["requests"]["cpu"]


def test_the_secret_holds_what_the_readme_tells_the_operator_to_put_in_it(objects) -> None:
    wanted = set()
    for w in workloads(objects):
        for v in w["spec"]["template"]["spec"]["volumes"]:
            secret = v.get("secret")
            if secret and secret["secretName"] == "kvroute-keys":
                wanted |= {i["key"] for i in secret.get("items", [])}
        for m in w["spec"]["template"]["spec"]["containers"][0].get("volumeMounts", []):
            if m["name"] == "keys":
                wanted.add(m["subPath"])
    readme = (ROOT / "deploy" / "README.md").read_text()
    (create,) = [line for line in readme.splitlines() if "kubectl create secret generic kvroute-keys" in line]
    assert set(re.findall(r"--from-file=(?:keys/)?([\w.]+)", create)) == wanted
