"""Tiny random-weight models of the hybrid, recurrent and sliding-window architectures (issue 48), written at test time
from a recipe: the metadata and the tensor names, shapes and types of the GGUF that llama.cpp's own
`tests/test-llama-archs.cpp -a ARCH -o DIR` writes (built from the vendored tree), with fresh random weights (normal,
stdev 0.1, as that test draws them; a Mamba `ssm_a` negative: a state decays). Recipes are a few KiB of JSON
(tests/fixtures/archs/ARCH.json); the models they give are about 5 MiB each, too many MiB to keep in the repository,
and a recipe keeps exactly the layout llama.cpp expects without a copy of its per-architecture writer here.

Such a model has no real vocabulary (`tok_0`..`tok_127`, llama.cpp's "test" tokenizer model): prompts are token ids.
What it says is noise; how its memory is kept, cut and restored is llama.cpp's real code for that architecture.

    .venv/bin/python -m bench.tiny_archs recipe SRC.gguf OUT.json   (once, from test-llama-archs's output)
    .venv/bin/python -m bench.tiny_archs write ARCH OUT.gguf          (a model from tests/fixtures/archs/ARCH.json)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from common.files import made_once

RECIPES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "archs"
# llama.cpp's names (general.architecture) of the architectures issue 48 names, and the sliding-window one
ARCHS = ("qwen35", "qwen3next", "nemotron_h", "granitehybrid", "lfm2", "mamba2", "jamba", "falcon-h1", "gemma3")
STDEV = 0.1
CACHE = Path.home() / ".cache" / "kvroute" / "archs"
_WRITER_OWNS = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def recipe(src: Path) -> dict[str, Any]:
    """What `write` needs of a GGUF: its metadata (key, type, value) and its tensors (name, shape, type); no weights."""
    reader = GGUFReader(str(src))
    fields: list[list[Any]] = []
    for key, field in reader.fields.items():
        if key in _WRITER_OWNS:
            continue
        kind = GGUFValueType(field.types[0])
        if kind is GGUFValueType.ARRAY:
            sub = GGUFValueType(int(field.parts[3][0]))  # (the element type, which `types` omits for an empty array)
            values = [_scalar(field.parts[i], sub) for i in field.data]
            fields.append([key, kind.name, values, sub.name])
        else:
            fields.append([key, kind.name, _scalar(field.parts[field.data[0]], kind)])
    tensors = [[t.name, [int(d) for d in t.shape], GGMLQuantizationType(t.tensor_type).name] for t in reader.tensors]
    return {"arch": _arch(reader), "fields": fields, "tensors": tensors}


def _arch(reader: GGUFReader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _scalar(part: Any, kind: GGUFValueType) -> Any:
    if kind is GGUFValueType.STRING:
        return bytes(part).decode()
    value = part[0]
    if kind is GGUFValueType.BOOL:
        return bool(value)
    return float(value) if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else int(value)


def write(arch: str, out: Path, seed: int = 0, repeat: int = 1, n_ctx: int = 0, stdev: float = STDEV) -> Path:
    """Write a model of `arch` from its recipe, with random weights drawn from `seed`; `repeat` > 1: its layers that
    many times over (the same pattern of recurrent and attention layers, `repeat` times the compute: a model whose
    time means something, for bench/hybrid_turns.py); `n_ctx`: the context it says it was trained for (0: the
    recipe's, 256; llama-server caps a slot there); `stdev`: of the weights (larger: sharper attention, whose
    outputs then tell positions apart: tests/worker/test_engine_mrope.py)."""
    spec = json.loads((RECIPES / f"{arch}.json").read_text())
    w = GGUFWriter(str(out), spec["arch"])
    n_layer = next(v for k, _, v, *_ in spec["fields"] if k.endswith(".block_count"))
    for key, kind, value, *sub in spec["fields"]:
        if sub and not value:
            continue  # (gguf writes no empty array; llama.cpp reads a missing one as empty: merges, labels)
        if key.endswith(".block_count"):
            value = n_layer * repeat
        elif key.endswith(".context_length") and n_ctx:
            value = n_ctx
        elif sub and len(value) == n_layer and not key.startswith("tokenizer."):
            value = value * repeat  # (a value per layer)
        vtype = GGUFValueType[kind]
        w.add_key_value(key, value, vtype, GGUFValueType[sub[0]] if sub else None)
    rng = np.random.default_rng(seed)
    for name, shape, kind in _layers(spec["tensors"], n_layer, repeat):
        dtype = {"F32": np.float32, "F16": np.float16}[kind]
        values = rng.standard_normal(tuple(reversed(shape))) * stdev  # (numpy's order is ggml's reversed)
        if "ssm_a" in name:
            values = -np.abs(values)
        w.add_tensor(name, values.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _layers(tensors: list[list[Any]], n_layer: int, repeat: int) -> list[list[Any]]:
    """The recipe's tensors with layer i's also as layer i + k * n_layer for each of the `repeat` copies."""
    out = [t for t in tensors if not t[0].startswith("blk.")]
    for k in range(repeat):
        for name, shape, kind in tensors:
            if name.startswith("blk."):
                _, i, rest = name.split(".", 2)
                out.append([f"blk.{int(i) + k * n_layer}.{rest}", shape, kind])
    return out


def model(arch: str, repeat: int = 1, n_ctx: int = 0, stdev: float = STDEV) -> Path:
    """The model of `arch` (seed 0; `repeat`, `n_ctx`, `stdev`: as in `write`) in ~/.cache/kvroute/archs, written on
    first use (the tests' and benches' copy; named by its recipe's digest: a changed recipe writes a new one)."""
    digest = hashlib.sha256((RECIPES / f"{arch}.json").read_bytes()).hexdigest()[:12]
    variant = f"{f'-x{repeat}' if repeat > 1 else ''}{f'-c{n_ctx}' if n_ctx else ''}{f'-s{stdev:g}' if stdev != STDEV else ''}"
    out = CACHE / f"{arch}-{digest}{variant}.gguf"
    return made_once(out, lambda tmp: write(arch, tmp, repeat=repeat, n_ctx=n_ctx, stdev=stdev))


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "recipe":
        Path(argv[2]).write_text(json.dumps(recipe(Path(argv[1])), separators=(",", ":")) + "\n")
        return 0
    if len(argv) == 3 and argv[0] == "write":
        write(argv[1], Path(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
