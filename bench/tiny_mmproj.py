"""A tiny Gemma 3 projector GGUF ("mmproj") with seeded random weights, a tiny Qwen2-VL one (`qwen2vl_mmproj`, below),
and tiny PNGs, so that images run end to end through llama.cpp's multimodal library (mtmd) here, where no multimodal
model can be downloaded (issue 64).

The file is what llama.cpp's converter writes for Gemma 3 (conversion/gemma.py `Gemma3VisionModel`), shrunk:
`clip.projector_type = "gemma3"`, a SigLIP ViT (conv patch embedding + learned positions, pre-norm blocks with
biased q/k/v/out and a GELU MLP, a post layernorm), then the Gemma 3 projector: an average pool of the patch grid
(kernel `clip.vision.projector.scale_factor`, default 4), an RMS norm times `mm.soft_emb_norm.weight`, and
`mm.input_projection.weight` (vision width x text width). Defaults: 64x64 images, 8x8 patches (an 8x8 grid), 2
layers of width 32, pooled by 2: 16 tokens per image, each a row of the text model's width (640 for Gemma 3 270M).
The text model should be Gemma 3 (its `<start_of_image>`/`<end_of_image>` tokens wrap the image), and its width must
be the projector's (mtmd_init_from_file refuses a mismatch). What it sees is noise; how it is computed is not.

    .venv/bin/python -m bench.tiny_mmproj OUT.gguf [N_EMBD]     # write one (N_EMBD: the text model's, 640)
    .venv/bin/python -m bench.tiny_mmproj --check                # the default model + this under llama-server

What a worker needs to know of mtmd (llama.cpp of llama-cpp-python 0.3.36, `llama_cpp.mtmd_cpp`; checked by
tests/worker/test_tiny_mmproj.py where it says so):

- Calls: `ctx = mtmd_init_from_file(mmproj, model, params)`, params from `mtmd_context_params_default()` with
  `use_gpu`, `n_threads`, `print_timings=False`, `warmup` set and `media_marker` left at `mtmd_default_marker()`
  ("<__media__>"; llama-server puts a random "<__media_XXXX__>" there so that no user text can be taken for one).
  NULL on a bad file or, with a loaded model, a projector of another width (tested). `mtmd_helper_log_set(cb, None)`
  routes mtmd's own log (it prints to stderr otherwise). Per image `mtmd_helper_bitmap_init_from_buf(ctx, buf, len,
  False)` (stb_image: png/jpeg/bmp/gif; NULL when it cannot decode). `chunks = mtmd_input_chunks_init()`,
  `mtmd_tokenize(ctx, chunks, byref(mtmd_input_text(text, len, add_special, parse_special)), bitmaps, n)`: 0, or 2
  when markers and bitmaps differ in number (mtmd.h says 1; the check throws and is caught as 2) or an image cannot
  be preprocessed. The text is the templated prompt with one marker per image, in order. For Gemma 3
  "Look:<__media__> what?" is three chunks (tested): text [BOS, Look, :, <start_of_image>], the image (16 rows here,
  256 for the real Gemma 3), text [<end_of_image>, what, ?]. A text chunk's ids: `mtmd_input_chunk_get_tokens_text`.
  An image chunk: `mtmd_encode_chunk(ctx, chunk)` (0 = ok) then `mtmd_get_output_embd(ctx)`, n_tokens x n_embd
  floats row-major, owned by ctx and overwritten by the next encode; or `mtmd_helper_eval_chunk_single` (below).
- Ownership: bitmaps may be freed (`mtmd_bitmap_free`) once tokenized: chunks hold the preprocessed image (tested).
  `mtmd_input_chunks_free` frees the list and its chunks; `mtmd_input_chunks_get` lends one; `mtmd_input_chunk_copy`
  gives an owned one (`mtmd_input_chunk_free`), what llama-server keeps per prompt. `mtmd_free(ctx)` before the llama
  model it was made with. `mtmd_input_chunk_save`/`_load` serialise a chunk without its pixels (a loaded chunk is a
  placeholder: it counts, encoding it fails).
- Ids: `mtmd_helper_bitmap_init_from_buf` names the bitmap by the SHA-256 (64 hex characters) of the file's bytes,
  not FNV any more (`mtmd_bitmap_set_id` overrides it, placeholder=True leaves it empty); tokenize copies it to the
  image chunk, `mtmd_input_chunk_get_id` (tested). llama-server keeps LLAMA_TOKEN_NULL at an image's positions and
  matches two prompts' images by (id, n_tokens) in its prefix compare, so the same bytes again reuse the image's KV
  (--check: the second identical request had cache_n 29 of 34). The same bytes encode to the same rows bit for bit.
- n_tokens vs n_pos: n_tokens is the rows (KV cells) an image takes, n_pos the positions it advances. They differ only
  when `mtmd_decode_use_mrope(ctx)` (Qwen-VL's M-RoPE: 4 position values per row, fewer positions than rows); Gemma 3
  has mrope false and n_pos == n_tokens (tested). `mtmd_helper_get_n_tokens`/`_get_n_pos` sum a list of chunks.
- `mtmd_helper_eval_chunk_single(ctx, lctx, chunk, n_past, seq_id, n_batch, logits_last, &new_n_past)`: a text chunk
  is decoded in batches of n_batch at positions n_past.., logits on its last token if logits_last, and it ADDS the
  tokens to `*new_n_past` (start it at n_past, as mtmd_helper_eval_chunks does). An image chunk is encoded, its rows
  decoded as embeddings in batches of n_batch at positions n_past.. with no logits whatever logits_last says (decode
  a text token after it to sample), and `*new_n_past = n_past + n_pos`. When `mtmd_decode_use_non_causal(ctx, chunk)`
  (Gemma 3: true, for every chunk: it looks at the projector only) it calls `llama_set_causal_attn(lctx, False)`
  around the image's decodes, and llama.cpp ASSERTS n_ubatch >= the rows of each such decode: a context with n_ubatch
  8 and an image of 16 rows aborts the process (SIGABRT, llama-context.cpp:1787; seen), and so does an n_batch given
  above the context's n_batch (the helper's batch overflows: mtmd-helper-common.h:158, seen). So the context's
  n_batch and n_ubatch, and the n_batch given, must be >= an image's n_tokens (256 for the real Gemma 3); an n_batch
  given below it splits the image over decodes, its first rows then not seeing the later ones. It decodes
  (llama_process) for one seq_id itself, so a worker that puts many slots in one llama_decode must instead encode
  (`mtmd_encode_chunk`), add the rows to its own batch as embeddings, and turn causal attention off for that decode
  alone (`mtmd_helper_decode_image_chunk` decodes given rows the helper's way). Encoding this projector takes
  ~0.25 ms on one thread; with 2 threads on a busy 2-core machine ~0.45 s (ggml's thread barriers): in tests give
  mtmd 1 thread.
- Vocab only (the router): `mtmd_init_from_file` takes a `vocab_only=True` llama model (tested). Its n_embd reads 0,
  so the width check is skipped (a projector of any width loads); the rope type (so mrope) and the vocabulary are
  there, so `mtmd_tokenize` lays out the chunks and counts an image's rows exactly as the worker will. clip still
  loads the whole projector (~0.8 GB f16 for the real Gemma 3; set `warmup=False`, `use_gpu=False`) and can even
  encode a real bitmap. To count alone, a placeholder bitmap (`mtmd_bitmap_init(nx, ny, None)`, or the helper with
  placeholder=True) tokenizes without pixels and refuses to encode (tested); for Gemma 3 the count does not depend
  on the image (it is resized to image_size), for dynamic-size projectors (Qwen-VL, Pixtral) it does on nx, ny.

Qwen-VL (`qwen2vl_mmproj`: clip's `qwen2vl_merger`, a ViT with 2D rope whose 2x2 neighbouring patches the merger
makes one row; tested on the tiny qwen35 model of bench/tiny_archs.py). M-RoPE comes from the text model, not the
projector: mtmd.cpp sets its position type from `llama_model_rope_type` (MROPE or IMROPE: qwen35's), so a vocab-only
model tells it too (tested). The image is resized (bicubic, its aspect kept, padded black) to multiples of 2 x patch
a side with between 8 and 4096 merged patches (clip.cpp `set_limit_image_tokens(8, 4096)`; the loader reads no
min/max pixels for this type, only the context's `image_min_tokens`/`image_max_tokens` move them), `qwen2vl_grid`
(checked once against mtmd on 3000 random sizes): an nx x ny grid of rows in row-major order. n_tokens = nx * ny rows,
each a KV cell; n_pos = max(nx, ny) (mtmd.cpp `mtmd_image_tokens_get_n_pos`). Row i's positions
(`mtmd_image_tokens_get_decoder_pos`): temporal t = n_past for every row, y = n_past + i//nx and x = n_past + i%nx in
the next two M-RoPE sections (mtmd-helper-common.h `set_position_mrope_2d`), the fourth 0; the text after it starts
at n_past + max(nx, ny) (tested: "Look:<__media__> what?" is text 5, image 8 rows / 4 positions, text 5; 14
positions, the last at 13, in 18 cells). A KV cell keeps the temporal position, so after an image
`llama_memory_seq_pos_max` is the n_past it started at, and a batch given no positions (`llama_batch_get_one`) would
go on from there + 1, inside the image's span (tested): text after an image needs its positions set (llama.cpp only
checks they move forward; "non-consecutive token position" in its log is find_slot noting the jump). The rows are
causal (`mtmd_decode_use_non_causal` false: no n_ubatch assert, they may be split over decodes). mtmd puts
"<|vision_start|>"/"<|vision_end|>" text around the image (with the test vocabulary, 4 and 3 tokens). The clamp can
exceed 4096 on an extreme aspect ratio: a side rounds up to 2 x patch first, so 1 x 40000 pixels gives 1 x 12800 rows
(transformers refuses ratios over 200; mtmd takes it): a router should bound an image's n_tokens itself. The real
Qwen2-VL (patch 14) is 28 x 28 pixels a row: 8 to 4096 rows.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

PROJECTOR_TYPE = "gemma3"
SIGLIP_MEAN = [0.5, 0.5, 0.5]  # Gemma 3's SigLIP preprocessing
SIGLIP_STD = [0.5, 0.5, 0.5]
DEFAULT_N_EMBD = 640  # Gemma 3 270M, the default model


def mmproj(
    path: Path,
    text_model_n_embd: int = DEFAULT_N_EMBD,
    seed: int = 0,
    image_size: int = 64,
    patch_size: int = 8,
    pool: int = 2,
    n_embd: int = 32,
    n_layer: int = 2,
    n_head: int = 2,
    n_ff: int = 64,
    eps: float = 1e-6,
) -> Path:
    """Write a Gemma 3 projector GGUF to `path`: ((image_size / patch_size) / pool)^2 tokens per image (16 by
    default), each `text_model_n_embd` wide. `n_ff` must not equal `n_embd` (the loader swaps the MLP's up and down
    matrices when down's input width is n_embd, for old files written that way)."""
    side = image_size // patch_size
    if image_size % patch_size or side % pool or n_embd % n_head or n_ff == n_embd:
        raise ValueError("image_size/patch_size/pool/n_embd/n_head/n_ff do not fit")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "clip")  # (MODEL_ARCH.MMPROJ: the converter's general.architecture)
    w.add_type("mmproj")
    w.add_name("tiny-gemma3-mmproj")
    w.add_file_type(1)  # mostly f16
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(PROJECTOR_TYPE)
    w.add_vision_projection_dim(text_model_n_embd)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch_size)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_image_mean(SIGLIP_MEAN)
    w.add_vision_image_std(SIGLIP_STD)
    w.add_vision_attention_layernorm_eps(eps)
    w.add_vision_use_gelu(True)
    if pool != 4:  # (the loader's default for gemma3; the converter writes it only for other values)
        w.add_vision_projector_scale_factor(pool)

    def t(name: str, *shape: int, dtype: type = np.float32, scale: float = 0.1, base: float = 0.0) -> None:
        # numpy's shape is ggml's ne reversed: (rows, columns) of a matrix is ne = [columns, rows]
        w.add_tensor(name, (base + rng.standard_normal(shape) * scale).astype(dtype))

    # the converter keeps the embeddings f32 and writes the other matrices f16, norms and biases f32
    t("v.patch_embd.weight", n_embd, 3, patch_size, patch_size)  # conv2d kernel: ne [p, p, 3, n_embd]
    t("v.patch_embd.bias", n_embd)
    t("v.position_embd.weight", side * side, n_embd)
    for i in range(n_layer):
        p = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t(f"{p}.{name}.weight", n_embd, n_embd, dtype=np.float16)
            t(f"{p}.{name}.bias", n_embd)
        t(f"{p}.ln1.weight", n_embd, base=1.0)
        t(f"{p}.ln1.bias", n_embd)
        t(f"{p}.ln2.weight", n_embd, base=1.0)
        t(f"{p}.ln2.bias", n_embd)
        t(f"{p}.ffn_up.weight", n_ff, n_embd, dtype=np.float16)  # ne [n_embd, n_ff]
        t(f"{p}.ffn_up.bias", n_ff)
        t(f"{p}.ffn_down.weight", n_embd, n_ff, dtype=np.float16)  # ne [n_ff, n_embd]
        t(f"{p}.ffn_down.bias", n_embd)
    t("v.post_ln.weight", n_embd, base=1.0)
    t("v.post_ln.bias", n_embd)
    # HF's (vision width, text width) parameter, used as x @ W: ne [text, vision]; the graph transposes it
    t("mm.input_projection.weight", n_embd, text_model_n_embd, dtype=np.float16)
    t("mm.soft_emb_norm.weight", n_embd, base=1.0)  # (the converter has added Gemma's +1 already)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokens_per_image(image_size: int = 64, patch_size: int = 8, pool: int = 2) -> int:
    return (image_size // patch_size // pool) ** 2


QWEN2VL_PROJECTOR_TYPE = "qwen2vl_merger"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # Qwen2-VL's preprocessor_config (OpenAI CLIP's)
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
QWEN2VL_MERGE = 2  # spatial_merge_size: clip.cpp's Qwen2-VL graph and token counts hard-code 2x2
QWEN2VL_MIN_TOKENS, QWEN2VL_MAX_TOKENS = 8, 4096  # clip.cpp: set_limit_image_tokens(8, 4096) for Qwen-VL


def qwen2vl_mmproj(
    path: Path,
    text_model_n_embd: int = 256,
    seed: int = 0,
    patch_size: int = 4,
    n_embd: int = 32,
    n_layer: int = 2,
    n_head: int = 2,
    n_ff: int = 64,
    eps: float = 1e-6,
) -> Path:
    """Write a Qwen2-VL projector GGUF (`qwen2vl_merger`) to `path`: a ViT on patch_size^2-pixel patches with 2D
    M-RoPE, then the patch merger (each 2x2 patches one row, `text_model_n_embd` wide): a W x H image (after Qwen's
    smart resize, `qwen2vl_grid`) gives nx x ny = (W / 2p) x (H / 2p) rows. The default text width is the tiny
    qwen35 model's (bench/tiny_archs.py). `n_embd / n_head` (the head width) must be a multiple of 4 (the ViT's rope
    has 4 sections of head/4), and `n_ff` must not equal `n_embd` (the loader then swaps up and down, as in `mmproj`).
    """
    if n_embd % n_head or (n_embd // n_head) % 4 or n_ff == n_embd:
        raise ValueError("n_embd/n_head/n_ff do not fit")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "clip")
    w.add_type("mmproj")
    w.add_name("tiny-qwen2vl-mmproj")
    w.add_file_type(1)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(QWEN2VL_PROJECTOR_TYPE)
    w.add_vision_projection_dim(text_model_n_embd)
    # required, and unused: the size is dynamic, and the loader sets Qwen's own warmup size (46 x 46 merged patches)
    w.add_vision_image_size(patch_size * QWEN2VL_MERGE * 8)
    w.add_vision_patch_size(patch_size)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_image_mean(CLIP_MEAN)
    w.add_vision_image_std(CLIP_STD)
    w.add_vision_attention_layernorm_eps(eps)
    # no use_gelu/use_silu: the ViT MLP is QuickGELU, the loader's default. No spatial_merge_size (the loader reads
    # it, default 2, but the graph and token counts hard-code 2) and no min/max pixels (not read for Qwen2-VL: only
    # mtmd_context_params' image_min_tokens/image_max_tokens move the 8..4096 limits): as the converter writes.

    def t(name: str, *shape: int, dtype: type = np.float32, scale: float = 0.1, base: float = 0.0) -> None:
        # numpy's shape is ggml's ne reversed: (rows, columns) of a matrix is ne = [columns, rows]
        w.add_tensor(name, (base + rng.standard_normal(shape) * scale).astype(dtype))

    # HF's Conv3d (temporal patch 2) split by the converter into two conv2d kernels, ne [p, p, 3, n_embd] each; a
    # still image is convolved with both and summed (the graph needs both: it adds them). No bias, no positions
    # (the graph asserts no patch bias; positions are rope)
    t("v.patch_embd.weight", n_embd, 3, patch_size, patch_size, dtype=np.float16)
    t("v.patch_embd.weight.1", n_embd, 3, patch_size, patch_size, dtype=np.float16)
    for i in range(n_layer):
        p = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):  # (q, k, v: HF's fused qkv, split by the converter)
            t(f"{p}.{name}.weight", n_embd, n_embd, dtype=np.float16)
            t(f"{p}.{name}.bias", n_embd)
        t(f"{p}.ln1.weight", n_embd, base=1.0)  # (LayerNorm with bias: Qwen2-VL; 2.5 has RMS norms)
        t(f"{p}.ln1.bias", n_embd)
        t(f"{p}.ln2.weight", n_embd, base=1.0)
        t(f"{p}.ln2.bias", n_embd)
        t(f"{p}.ffn_up.weight", n_ff, n_embd, dtype=np.float16)  # ne [n_embd, n_ff]
        t(f"{p}.ffn_up.bias", n_ff)
        t(f"{p}.ffn_down.weight", n_embd, n_ff, dtype=np.float16)  # ne [n_ff, n_embd]
        t(f"{p}.ffn_down.bias", n_embd)
    t("v.post_ln.weight", n_embd, base=1.0)  # the merger's ln_q, on each patch before 2x2 are concatenated
    t("v.post_ln.bias", n_embd)
    # the merger's MLP on 4 concatenated patches: Linear(4 n_embd, 4 n_embd), GELU, Linear(4 n_embd, text)
    t("mm.0.weight", 4 * n_embd, 4 * n_embd, dtype=np.float16)  # ne [4 n_embd, 4 n_embd]
    t("mm.0.bias", 4 * n_embd)
    t("mm.2.weight", text_model_n_embd, 4 * n_embd, dtype=np.float16)  # ne [4 n_embd, text]
    t("mm.2.bias", text_model_n_embd)  # (its length is the projector's width mtmd checks against the model's)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def qwen2vl_grid(
    width: int, height: int, patch_size: int = 4, min_tokens: int = QWEN2VL_MIN_TOKENS, max_tokens: int = QWEN2VL_MAX_TOKENS
) -> tuple[int, int]:
    """(nx, ny): the merged-patch grid mtmd makes of a width x height image for `qwen2vl_mmproj`; an image chunk of
    nx * ny rows (n_tokens) and max(nx, ny) positions (n_pos). mtmd's dyn-size preprocessing (mtmd-image.cpp
    `calc_size_preserved_ratio`, transformers' smart_resize) rounds each side to a multiple of f = 2 * patch_size,
    then, above max_tokens * f^2 pixels, scales both sides down (floor to f) or, below min_tokens * f^2, up (ceil
    to f), keeping the aspect ratio (float32, as there). min/max_tokens: clip's 8 and 4096, or the context's
    image_min_tokens/image_max_tokens when set. With patch 4 (f = 8): 32x16 -> (4, 2), the smallest grid with nx !=
    ny that needs no resize (8 tokens, 4 positions); 24x16 rounds to 3x2 = 6 < 8 tokens and is scaled up to 32x24 ->
    (4, 3); 16x8 -> (4, 2)."""
    f32, f = np.float32, patch_size * QWEN2VL_MERGE
    min_px, max_px = min_tokens * f * f, max_tokens * f * f
    w_bar = max(f, int(np.floor(float(f32(width) / f32(f)) + 0.5)) * f)  # (std::round: half away from zero)
    h_bar = max(f, int(np.floor(float(f32(height) / f32(f)) + 0.5)) * f)
    if w_bar * h_bar > max_px:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_px))
        h_bar = max(f, int(np.floor(f32(height) / beta / f32(f))) * f)
        w_bar = max(f, int(np.floor(f32(width) / beta / f32(f))) * f)
    elif w_bar * h_bar < min_px:
        beta = np.sqrt(f32(min_px) / (f32(height) * f32(width)))
        h_bar = int(np.ceil(f32(height) * beta / f32(f))) * f
        w_bar = int(np.ceil(f32(width) * beta / f32(f))) * f
    return w_bar // f, h_bar // f


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A valid RGB PNG of seeded noise (8-bit, no interlace, filter 0 on each row)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check(
    out_dir: Path,
    model: Path | None = None,
    proj: Path | None = None,
    template: tuple[str, ...] = ("--no-jinja", "--chat-template", "gemma"),
    image: bytes | None = None,
    after: str = "",
) -> dict:
    """Serve a model (default: the default model, with the chat template kvroute's bench gives it: its GGUF has none)
    with a tiny projector (default: the Gemma 3 one) under llama-server and send one chat completion with an image
    (default: 48 x 40 noise; `after`: a text part after it) twice. Returns the rendered prompt and each reply's usage
    and timings."""
    from bench.llama_server import binary
    from common.model import default_model_path

    proj = proj or mmproj(out_dir / "tiny-mmproj.gguf")
    port = _free_port()
    log = out_dir / "llama-server.log"
    cmd = [str(binary()), "-m", str(model or default_model_path()), "--mmproj", str(proj), "-c", "2048", "-np", "1",
           "--port", str(port), "--host", "127.0.0.1", "-t", "2", *template]  # fmt: skip
    url = "data:image/png;base64," + base64.b64encode(image or png(48, 40, seed=1)).decode()
    body = {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}},
            *([{"type": "text", "text": after}] if after else []),
        ]}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
    }  # fmt: skip
    out: dict = {"tokens_per_image": tokens_per_image()}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, log)
        out["prompt"] = _post(f"{base}/apply-template", body)["prompt"]
        for n in (1, 2):
            t0 = time.perf_counter()
            reply = _post(f"{base}/v1/chat/completions", body)
            logprobs = (reply["choices"][0].get("logprobs") or {}).get("content") or []
            out[f"reply{n}"] = {"usage": reply.get("usage"), "timings": reply.get("timings"),
                                "seconds": round(time.perf_counter() - t0, 3),
                                "content": reply["choices"][0]["message"].get("content"),
                                "logprobs": [t["logprob"] for t in logprobs]}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(10)
    out["log"] = [ln for ln in log.read_text(errors="replace").splitlines() if "multimodal" in ln or "prompt eval" in ln]
    return out


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become healthy")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tiny-mmproj-") as tmp:
            print(json.dumps(check(Path(tmp)), indent=2))
        return 0
    if 1 <= len(argv) <= 2:
        mmproj(Path(argv[0]), int(argv[1]) if len(argv) == 2 else DEFAULT_N_EMBD)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
