"""A model of the default model's shape that travels: every tensor's type, shape and place in the file kept, its data
its own first rows repeated, so that the GGUF (253 MB) compresses to a few MB and fits a device command's 64 MiB.

The speed of a step does not depend on the weights (the same kernels run over the same bytes), so timings on it hold
for the default model; what the model says does depend on them and is checked on CPU with the real file.

    .venv/bin/python -m bench.gpu.shaped_model OUT.gguf.xz             # from the default model, here
    python3 -m bench.gpu.shaped_model --unpack OUT.gguf.xz MODEL.gguf  # there: every token's embedding made its own

Repeated embedding rows would give tokens equal logits (Gemma's output layer is its embedding), so greedy choices
would tie; unpacking fills the embedding's quantized values with seeded draws from its first rows' values (its scales kept),
so every token differs again, as in a real model.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import tempfile
from pathlib import Path

from gguf import GGUFReader

KEEP_BYTES = 8 * 1024  # data kept per tensor before it repeats (the embedding's values are made unique on unpacking)


def shape_copy(src: Path, dst: Path) -> None:
    """`dst`: `src` with each tensor's data tiled from its first whole rows."""
    shutil.copyfile(src, dst)
    reader = GGUFReader(src)
    with open(dst, "r+b") as out:
        for t in reader.tensors:
            data = t.data.reshape(t.data.shape[0], -1).view("uint8") if t.data.ndim > 1 else t.data.view("uint8")
            row = data.nbytes // len(data) if t.data.ndim > 1 else data.nbytes
            rows = max(1, KEEP_BYTES // row)
            if rows >= len(data) or t.data.ndim == 1:
                continue
            tile = data[:rows].tobytes()
            whole = (tile * (len(data) // rows + 1))[: data.nbytes]
            out.seek(t.data_offset)
            out.write(whole)


def unique_embedding(path: Path, seed: int = 0) -> None:
    """Give every row of a Q8_0 token embedding its own values, drawn (seeded) from the first rows' values; each
    block keeps its scale."""
    import numpy as np

    reader = GGUFReader(path, "r+")
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    if t.tensor_type.name != "Q8_0":
        raise SystemExit(f"token_embd.weight is {t.tensor_type.name}; only Q8_0 is handled")
    blocks = t.data.view(np.uint8).reshape(-1, 34)  # Q8_0: an f16 scale, then 32 int8 values
    rng = np.random.default_rng(seed)
    real = blocks[: max(1, KEEP_BYTES // 34), 2:].ravel().copy()  # the first rows, as the real model has them
    blocks[:, 2:] = rng.choice(real, size=(len(blocks), 32))  # drawn from them: the real model's magnitudes
    reader.data.flush()


def main() -> None:
    from common.model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the compressed GGUF to write (.gguf.xz), or with --unpack the one to read")
    p.add_argument("gguf", type=Path, nargs="?", help="with --unpack: the GGUF to write")
    p.add_argument("--unpack", action="store_true", help="decompress OUT into GGUF, every embedding row its own")
    p.add_argument("--model", type=Path, default=None, help="the GGUF to copy the shape of (default: the default model)")
    a = p.parse_args()
    if a.unpack:
        with lzma.open(a.out, "rb") as z, open(a.gguf, "wb") as f:
            shutil.copyfileobj(z, f, 1 << 20)
        unique_embedding(a.gguf)
        print(f"{a.gguf}: {a.gguf.stat().st_size >> 20} MiB")
        return
    src = a.model or Path(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "shaped.gguf"
        shape_copy(src, plain)
        with open(plain, "rb") as f, lzma.open(a.out, "wb", preset=6) as z:
            shutil.copyfileobj(f, z, 1 << 20)
    print(f"{a.out}: {a.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
