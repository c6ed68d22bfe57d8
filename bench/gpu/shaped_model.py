"""A model of the default model's shape that travels: every tensor's type, shape and place in the file kept, its data
its own first rows repeated, so that the GGUF (253 MB) compresses to a few MB and fits a device command's 64 MiB.

The speed of a step does not depend on the weights (the same kernels run over the same bytes), so timings on it hold
for the default model; what the model says does depend on them and is checked on CPU with the real file. Tokens that
differ still give different states (the first rows of the embedding, about 1 MB of it, are kept as they are).

    .venv/bin/python -m bench.gpu.shaped_model OUT.gguf.xz     # from the default model
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import tempfile
from pathlib import Path

from gguf import GGUFReader

KEEP_BYTES = 32 * 1024  # data kept per tensor before it repeats
KEEP_EMBEDDING_BYTES = 1 << 20


def shape_copy(src: Path, dst: Path) -> None:
    """`dst`: `src` with each tensor's data tiled from its first whole rows."""
    shutil.copyfile(src, dst)
    reader = GGUFReader(src)
    with open(dst, "r+b") as out:
        for t in reader.tensors:
            data = t.data.reshape(t.data.shape[0], -1).view("uint8") if t.data.ndim > 1 else t.data.view("uint8")
            row = data.nbytes // len(data) if t.data.ndim > 1 else data.nbytes
            keep = KEEP_EMBEDDING_BYTES if t.name == "token_embd.weight" else KEEP_BYTES
            rows = max(1, keep // row)
            if rows >= len(data) or t.data.ndim == 1:
                continue
            tile = data[:rows].tobytes()
            whole = (tile * (len(data) // rows + 1))[: data.nbytes]
            out.seek(t.data_offset)
            out.write(whole)


def main() -> None:
    from kvroute.model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the compressed GGUF to write (.gguf.xz)")
    p.add_argument("--model", type=Path, default=None, help="the GGUF to copy the shape of (default: the default model)")
    a = p.parse_args()
    src = a.model or Path(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "shaped.gguf"
        shape_copy(src, plain)
        with open(plain, "rb") as f, lzma.open(a.out, "wb", preset=6) as z:
            shutil.copyfileobj(f, z, 1 << 20)
    print(f"{a.out}: {a.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
