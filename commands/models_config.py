"""`kvroute serve`'s models: `--model [NAME=]PATH` (repeatable) and a models file (`--models FILE`), read into one
list of models, each with the flags of its local workers.

The models file is TOML, one table per model:

    [models.coder]                      # its name (what the API's `model` field picks)
    path = "/models/qwen2.5-coder-7b-q4_k_m.gguf"
    aliases = ["gpt-4o", "claude-sonnet-4-5"]
    workers = 2                         # replicas on CPU (or gpus = "0,1": one worker per GPU)
    slots = 8
    ctx_per_slot = 16384
    pinned = true                       # never unloaded
    default = true                      # requests naming an unknown model go here

    [models.small]
    path = "gemma-3-270m"
    keep_alive = "10m"                  # unloaded after 10 minutes unused ("-1": kept; 0: at once)
    load = "on_demand"                  # started by its first request ("start", the default: at start)
    memory_mb = 900                     # what one worker takes, weights and KV (else estimated: --models-memory-mb)
    mmproj = "/models/mmproj-gemma-3-4b.gguf"  # its vision projector: requests may send images (llama-server's --mmproj)
    temp = 0.6                          # sampling for requests that leave it to the server: temp, top_k, top_p,
    top_k = 20                          # min_p, repeat_penalty, repeat_last_n, seed (else the flag's, else the GGUF's
                                        # general.sampling.*, else llama-server's)
    generic_tools = true                # its template has no tool syntax: show it tools in a generic JSON format
                                        # (else the flag's, --generic-tools; off: tools are a hint for such a model)

A key a model does not give is the `serve` flag's value (`--slots`, `--workers`, ...).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from common.config import ConfigFileError, keep_alive_seconds, read_toml
from router.models import ServedModel, from_flag
from router.sampling_defaults import out_of_bounds

# per-model keys that set a LocalWorkers field of the same name
WORKER_KEYS = {"workers": "cpu_workers", "gpus": "gpus", "slots": "slots", "ctx_per_slot": "ctx_per_slot",
               "kv_budget_mb": "kv_budget_mb", "threads": "threads", "n_gpu_layers": "n_gpu_layers",
               "host_cache_mb": "host_cache_mb", "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v",
               "flash_attn": "flash_attn"}  # fmt: skip
MODEL_KEYS = {"path", "aliases", "pinned", "keep_alive", "load", "default", "memory_mb", "mmproj", "generic_tools"}
# per-model sampling defaults (router/sampling_defaults.py), named as the `serve` flags are -> the `Sampling` field
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
                 "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n"}  # fmt: skip


@dataclass(frozen=True)
class ModelEntry:
    """One model to serve: what the router knows of it, and its workers' flags (LocalWorkers fields to override)."""

    served: ServedModel
    workers: dict[str, Any] = dataclasses.field(default_factory=dict)
    default: bool = False


def worker_prefix(name: str) -> str:
    """A model's name as the start of its workers' ids (and their disk-tier directories): no path separators."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def from_flags(values: list[str], keep_alive: float) -> list[ModelEntry]:
    """`--model [NAME=]PATH`, each given once or more: a PATH alone is named by its file."""
    return [ModelEntry(from_flag(value, keep_alive)) for value in values]


def seconds(value: Any, where: str) -> float:
    """A keep-alive (common.config.keep_alive_seconds); ConfigFileError naming `where`."""
    try:
        return keep_alive_seconds(value)
    except ValueError as exc:
        raise ConfigFileError(f"{where}: {exc}") from None


def sampling_of(table: dict[str, Any], where: str) -> tuple[tuple[str, float | int], ...]:
    """A model's sampling defaults (`temp = 0.6`, `top_k = 20`, ...), by `Sampling` field; ConfigFileError naming a
    wrong one."""
    out = []
    for key, name in SAMPLING_KEYS.items():
        if key not in table:
            continue
        value = table[key]
        integral = name in ("top_k", "seed", "repeat_last_n")
        if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
            raise ConfigFileError(f"{where}: `{key}` must be {'an integer' if integral else 'a number'}, got {value!r}")
        if why := out_of_bounds(name, value):
            raise ConfigFileError(f"{where}: `{key}` {why}")
        out.append((name, value))
    return tuple(out)


def mmproj_of(table: dict[str, Any], where: str) -> str | None:
    """A model's vision projector file (`mmproj = "/models/mmproj-gemma3.gguf"`), or None."""
    value = table.get("mmproj")
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigFileError(f"{where}: `mmproj` must be the path of a projector GGUF, got {value!r}")
    return value


def from_file(path: str, keep_alive: float) -> list[ModelEntry]:
    """The `[models.NAME]` tables of a TOML file; a wrong key or value raises ConfigFileError naming it."""
    tables = read_toml(path, "models file").get("models")
    if not isinstance(tables, dict) or not tables:
        raise ConfigFileError(f"{path}: no [models.NAME] table")
    out = []
    for name, table in tables.items():
        where = f"{path}: [models.{name}]"
        if not isinstance(table, dict):
            raise ConfigFileError(f"{where} must be a table")
        unknown = set(table) - MODEL_KEYS - set(WORKER_KEYS) - set(SAMPLING_KEYS)
        if unknown:
            known = ", ".join(sorted(MODEL_KEYS | set(WORKER_KEYS) | set(SAMPLING_KEYS)))
            raise ConfigFileError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {known})")
        if not isinstance(table.get("path"), str) or not table["path"]:
            raise ConfigFileError(f"{where}: `path` (a GGUF file or a model name) is required")
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ConfigFileError(f"{where}: `aliases` must be a list of names")
        load = table.get("load", "start")
        if load not in ("start", "on_demand"):
            raise ConfigFileError(f'{where}: `load` must be "start" or "on_demand", got {load!r}')
        for key in ("pinned", "default", "generic_tools"):
            if not isinstance(table.get(key, False), bool):
                raise ConfigFileError(f"{where}: `{key}` must be true or false")
        memory = table.get("memory_mb", 0)
        if isinstance(memory, bool) or not isinstance(memory, int | float) or memory < 0:
            raise ConfigFileError(f"{where}: `memory_mb` must be a number of MiB, got {memory!r}")
        served = ServedModel(
            name=name,
            path=table["path"],
            aliases=tuple(aliases),
            pinned=table.get("pinned", False),
            keep_alive_s=seconds(table["keep_alive"], f"{where} keep_alive") if "keep_alive" in table else keep_alive,
            load_at_start=load == "start",
            memory_mb=float(memory),
            memory_given=memory > 0,
            sampling=sampling_of(table, where),
            mmproj=mmproj_of(table, where),
            generic_tools=table.get("generic_tools"),
        )
        workers = {WORKER_KEYS[k]: v for k, v in table.items() if k in WORKER_KEYS}
        if "gpus" in workers:  # (gpus = 0, gpus = [0, 1] or gpus = "0,1")
            gpus = workers["gpus"]
            workers["gpus"] = ",".join(map(str, gpus)) if isinstance(gpus, list) else str(gpus)
        out.append(ModelEntry(served, workers, default=table.get("default", False)))
    return out
