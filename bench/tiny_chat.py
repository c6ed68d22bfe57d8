"""Tiny chat GGUFs with seeded random weights that carry a model family's chat template and its marker tokens, for
end-to-end tests of tool calls and thinking on the families people run (no such model can be downloaded here).

Each is Qwen 3's layout (the weights' shapes do not change what a template or a parser does) with a byte-level BPE
vocabulary: every byte, a token for each word of the probe tools, and one token for each marker the template writes
(`<|im_start|>`, `<tool_call>`, `[TOOL_CALLS]`, DeepSeek's fullwidth markers, ...). Markers that end a turn are
control tokens, as in the real models (llama.cpp takes them for end-of-generation by their text); the others are
user-defined tokens, which a prompt's text and a grammar's literals both spell as one token. What such a model says is
noise; forced by a grammar, it writes a call as the family's syntax says.

    .venv/bin/python -m bench.tiny_chat Qwen3-Coder OUT.gguf
"""

# ruff: noqa: RUF001 (DeepSeek's markers are written with fullwidth bars)
from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import numpy as np
from gguf import TokenType

from bench.tiny_models import _bytes_to_unicode, _random, _word_merges, _write, _writer

TEMPLATES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "templates"
# the families issue 47 names: a short name -> the vendored template
FAMILIES = {
    "qwen3.5": "Qwen3.5-4B",
    "qwen3-coder": "Qwen3-Coder",
    "glm-4.7": "GLM-4.7-Flash",
    "gpt-oss": "openai-gpt-oss-120b",
    "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1",
    "kimi-k2": "Kimi-K2-Thinking",
    "minimax-m2": "MiniMax-M2",
    "nemotron-3-nano": "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "devstral": "unsloth-mistral-Devstral-Small-2507",
}
MARKER = re.compile(
    r"<\|[^|<>\s'\"]{1,40}\|>"  # <|im_start|>, <|channel|>
    r"|<｜[^｜<>\s]{1,40}｜>"  # DeepSeek's fullwidth markers
    r"|\[/?[A-Z_]{2,20}\]"  # [TOOL_CALLS], [ARGS], [INST]
    r"|</?[a-z][a-z_]{1,30}(?::[a-z_]{1,30})?>"  # <tool_call>, </think>, <seed:think>, <minimax:tool_call>
    r"|\]~[be]\]|\[e~\["  # MiniMax's turn markers
)
END_OF_TURN = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|return|>", "<|call|>", "</s>",
               "<｜end▁of▁sentence｜>", "[e~[", "<|user|>", "<|observation|>", "<|end_of_text|>"}  # fmt: skip
WORDS = ["get", "weather", "city", "days", "units", "paris", "rome", "oslo", "write", "file", "path", "content",
         "search", "query", "the", "and", "user", "assistant", "system", "tool", "function", "name", "arguments"]  # fmt: skip


def markers(source: str) -> list[str]:
    """The marker tokens a template writes, in first-seen order."""
    found = dict.fromkeys(m.group(0) for m in MARKER.finditer(source))
    return [m for m in found if "{" not in m and m not in ("<s>",)]


def chat_model(
    path: Path,
    template: str,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_ctx: int = 4096,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    says: list[str] | None = None,
    words: list[str] | None = None,
    metadata: dict[str, int | float | str] | None = None,
) -> Path:
    """A tiny GGUF with the vendored template `template` (a file stem of tests/fixtures/templates).

    `says`: vocabulary entries (byte-level spelling: "Ċ" is a newline, "Ġ" a space) the model writes one after the
    other once its prompt ends with the first, whatever came before: a chain through the random weights, each entry's
    embedding a long step along a dimension of its own and the next entry's output row along the same, so every
    sampler follows it (a real client's agent loop, run on noise, needs a reply that ends).
    `words`: more words made one token each (with and without a space before), as a real vocabulary covers the text
    it is given (Claude Code's system prompt and tools are 44k tokens spelled byte by byte, 14k with its words).
    `metadata`: more keys (e.g. `general.sampling.top_k`), written as int32, float32 or string by their value's type."""
    source = (TEMPLATES / f"{template}.jinja").read_text()
    rng = np.random.default_rng(seed)
    alphabet = _bytes_to_unicode()
    merged, merges = _word_merges(alphabet, WORDS + (words or []))
    marks = [m for m in markers(source) if m not in alphabet + merged]
    bos, eos = "<s>", next((m for m in marks if m in END_OF_TURN), "</s>")
    specials = [bos, *([eos] if eos not in marks else []), *marks]
    tokens = alphabet + merged + specials
    types = [TokenType.NORMAL] * (len(alphabet) + len(merged))
    types += [TokenType.CONTROL if t in END_OF_TURN or t == bos else TokenType.USER_DEFINED for t in specials]

    w = _writer(path, "qwen3", f"tiny-{template}", n_ctx, n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(bos))
    w.add_eos_token_id(tokens.index(eos))
    w.add_add_bos_token(False)
    w.add_chat_template(source)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_int32(key, value)
        else:
            w.add_float32(key, value)

    t = _random(w, rng, np.float32)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    n_vocab = len(tokens)
    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    out = (rng.standard_normal((n_vocab, n_embd)) * 0.3).astype(np.float32)
    if says:
        chain(tokens, says, embd, out)
    w.add_tensor("token_embd.weight", embd)
    ones("output_norm.weight", n_embd)
    w.add_tensor("output.weight", out)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight", n_embd)
        t(f"blk.{i}.attn_q.weight", n_head * head_dim, n_embd)
        t(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_head * head_dim)
        ones(f"blk.{i}.attn_q_norm.weight", head_dim)
        ones(f"blk.{i}.attn_k_norm.weight", head_dim)
        ones(f"blk.{i}.ffn_norm.weight", n_embd)
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    _write(w)
    return path


def chain(tokens: list[str], says: list[str], embd: np.ndarray, out: np.ndarray) -> None:
    """Makes each entry of `says` the next token after the one before it (see chat_model)."""
    missing = [s for s in says if s not in tokens]
    if missing or len(set(says)) != len(says) or len(says) > embd.shape[1]:
        raise ValueError(f"a chain names distinct vocabulary entries, at most one per dimension: {says} (missing: {missing})")
    for dim, (a, b) in enumerate(itertools.pairwise(says)):
        # 100 along one dimension outweighs what two layers add to the residual; after the RMS norm the next entry's
        # logit is about 10 * sqrt(n_embd), the others' a few units
        embd[tokens.index(a)] = 0.0
        embd[tokens.index(a), dim] = 100.0
        out[tokens.index(b)] = 0.0
        out[tokens.index(b), dim] = 10.0


if __name__ == "__main__":
    chat_model(Path(sys.argv[2]), FAMILIES.get(sys.argv[1], sys.argv[1]))
