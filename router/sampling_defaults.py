"""The sampling a request gets for the fields it leaves to the server (`Submit.sampling_unset`), per model.

In this order, field by field: the operator's value (the model's entry in a models file, then `--temp`, `--top-k`,
... on the command line); else the model's own, the `general.sampling.*` keys its authors wrote into the GGUF (read as
llama.cpp's common/common.cpp `common_init_sampler_from_model` reads them); else llama-server's defaults (common.h's
`common_params_sampling`). A request's own value always wins. `seed` has no model or llama-server value: without the
operator's, each request draws its own.

The GGUF may name samplers kvroute does not run (XTC, Mirostat, a custom order): those are listed as not applied
(`/props`, the router's start log), never silently taken as applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from protocol import DEFAULTABLE, sampling_bounds

# llama-server's values for a request that sets none (vendored common/common.h, common_params_sampling)
LLAMA_SERVER: dict[str, float | int] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repeat_penalty": 1.0,
    "repeat_last_n": 64,
}
# `Sampling` field -> its GGUF key (vendored src/llama-arch.cpp) and type
GGUF_KEYS: dict[str, tuple[str, type]] = {
    "temperature": ("general.sampling.temp", float),
    "top_k": ("general.sampling.top_k", int),
    "top_p": ("general.sampling.top_p", float),
    "min_p": ("general.sampling.min_p", float),
    "repeat_penalty": ("general.sampling.penalty_repeat", float),
    "repeat_last_n": ("general.sampling.penalty_last_n", int),
}
# samplers a GGUF may set that kvroute's chain (worker/sampling.py) does not have
NOT_RUN = (
    "general.sampling.sequence",
    "general.sampling.xtc_probability",
    "general.sampling.xtc_threshold",
    "general.sampling.mirostat",
    "general.sampling.mirostat_tau",
    "general.sampling.mirostat_eta",
)
# the fields an operator (a flag, a models file) may give a default of: `Sampling`'s defaultable ones, each within the
# values `Sampling` takes (protocol `sampling_bounds`: the bounds' one home), at most OPERATOR_MAX where that is less
OPERATOR_FIELDS: tuple[str, ...] = DEFAULTABLE
OPERATOR_MAX: dict[str, float] = {"temperature": 2.0, "top_k": 1 << 20, "repeat_last_n": 1 << 20}

Source = str  # "models file", "flag", "gguf", "llama-server"


def out_of_bounds(name: str, value: float) -> str | None:
    """Why `value` cannot be the default of field `name` (router/config.py, commands/models_config.py, a GGUF's), or
    None."""
    low, high, low_out = sampling_bounds(name)
    high = OPERATOR_MAX.get(name, high)
    assert low is not None and high is not None, name  # (each operator field has both)
    if low_out:
        return None if low < value <= high else f"must be more than {low} and at most {high}, got {value}"
    return None if low <= value <= high else f"must be between {low} and {high}, got {value}"


@dataclass(frozen=True)
class SamplingDefaults:
    values: dict[str, float | int] = field(default_factory=dict)  # by `Sampling` field name
    sources: dict[str, Source] = field(default_factory=dict)  # where each value came from
    not_applied: dict[str, str] = field(default_factory=dict)  # GGUF keys kvroute does not run, or could not read

    def described(self) -> str:
        """One line for logs: `temperature=0.6 (gguf), top_k=20 (gguf), ...`."""
        return ", ".join(f"{k}={v} ({self.sources[k]})" for k, v in self.values.items())


def _from_gguf(name: str, raw: str) -> float | int | None:
    """A GGUF value as llama.cpp reads it (strtol/strtof of its text), in our terms; None if it cannot be used."""
    key_type = GGUF_KEYS[name][1]
    try:
        value: float | int = int(float(raw)) if key_type is int else float(raw)
    except ValueError:
        return None
    if name == "top_k" and value <= 0:  # llama.cpp: <= 0 is the whole vocabulary, i.e. off
        value = 0
    if name == "temperature" and value < 0:  # llama.cpp: <= 0 samples greedily
        value = 0.0
    return None if out_of_bounds(name, value) else value


def resolve(
    model_file: Mapping[str, float | int], flags: Mapping[str, float | int | None], meta: Callable[[str], str | None]
) -> SamplingDefaults:
    """The defaults of one model: `model_file` (its models-file entry's values), `flags` (the router's, None: not
    given), `meta` (the GGUF's metadata by key: Vocab.meta)."""
    values: dict[str, float | int] = {}
    sources: dict[str, Source] = {}
    not_applied: dict[str, str] = {}
    for name in OPERATOR_FIELDS:
        flag = flags.get(name)
        if name in model_file:
            values[name], sources[name] = model_file[name], "models file"
        elif flag is not None:
            values[name], sources[name] = flag, "flag"
        elif name in GGUF_KEYS and (raw := meta(GGUF_KEYS[name][0])) is not None:
            if (value := _from_gguf(name, raw)) is None:
                not_applied[GGUF_KEYS[name][0]] = f"{raw} (not a usable value)"
            else:
                values[name], sources[name] = value, "gguf"
        if name not in values and name in LLAMA_SERVER:
            values[name], sources[name] = LLAMA_SERVER[name], "llama-server"
    for key in NOT_RUN:
        if (raw := meta(key)) is not None:
            not_applied[key] = raw
    return SamplingDefaults(values, sources, not_applied)
