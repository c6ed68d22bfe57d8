"""Reranker GGUFs with seeded random weights: tiny ones for the tests (no reranker can be downloaded here, and the
rerank path, prompt format, rank pooling and score, is tested against llama-server on the same file), and ones of a
real reranker's shape for bench.rerank (QWEN3_RERANKER_0_6B, BGE_RERANKER_BASE: a step's time does not depend on the
weights). What such a model says is noise; how it is computed is not.

- `qwen3_reranker`: Qwen3-Reranker's layout (causal, `rank` pooling read at the last token, a two-label head "yes"
  and "no" with a softmax, the `rerank` chat template llama.cpp's converter writes), a byte-level BPE vocabulary
  with a token for each word of the template and of WORDS.
- `bert_reranker`: a cross-encoder's layout (BERT, bidirectional, `rank` pooling read at [CLS], a classification
  head), a WordPiece vocabulary of letters, punctuation and a few words; its prompt is llama.cpp's "[CLS] query [SEP] doc".

    .venv/bin/python -m bench.tiny_models qwen3 OUT.gguf
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, PoolingType, TokenType

RERANK_TEMPLATE = (  # llama.cpp's converter writes this for Qwen3-Reranker (conversion/qwen.py)
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


QWEN3_RERANKER_0_6B = {"n_embd": 1024, "n_layer": 28, "n_ff": 3072, "n_head": 16, "n_head_kv": 8, "head_dim": 128}
BGE_RERANKER_BASE = {"n_embd": 768, "n_layer": 12, "n_ff": 3072, "n_head": 12}  # (XLM-RoBERTa: llama.cpp's BERT)


def _bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding of one pre-token: merge the adjacent pair of lowest rank until none has one."""
    while len(pieces) > 1:
        pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(itertools.pairwise(pieces))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _word_merges(alphabet: list[str], words: list[str]) -> tuple[list[str], list[str]]:
    """BPE merges that make each word (and the word after a space) one token, as a real vocabulary makes a common
    word, so that the template and the words a bench writes are about a token a word: the tokens, the merges. Each
    word's merges come after those before it and join what those leave of it, left to right; a word made whole
    stays whole as more merges come."""
    space = alphabet[ord(" ")]
    ranks: dict[tuple[str, str], int] = {}
    tokens: list[str] = []
    for word in dict.fromkeys(words):
        for spelled in (word, space + word):
            pieces = _bpe(list(spelled), ranks)
            while len(pieces) > 1:
                pair = (pieces[0], pieces[1])
                ranks[pair] = len(ranks)
                if pieces[0] + pieces[1] not in tokens:
                    tokens.append(pieces[0] + pieces[1])
                pieces[:2] = [pieces[0] + pieces[1]]
    return tokens, [f"{a} {b}" for a, b in ranks]


def _writer(path: Path, arch: str, name: str, n_ctx: int, n_embd: int, n_layer: int, n_ff: int, n_head: int) -> GGUFWriter:
    """A GGUF writer with the hyperparameters both layouts have."""
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    return w


def _random(w: GGUFWriter, rng: np.random.Generator, dtype: type) -> Callable[..., None]:
    """`t(name, *shape, scale=0.1)`: a tensor of seeded normal draws; matrices in `dtype`, the rest f32."""

    def t(name: str, *shape: int, scale: float = 0.1) -> None:
        # (norms, biases and the token-type rows, which are added, stay f32, as llama.cpp's converter keeps them)
        kind = dtype if len(shape) == 2 and name != "token_types.weight" else np.float32
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(kind))

    return t


def qwen3_reranker(
    path: Path,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_ctx: int = 2048,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    dtype: type = np.float32,
) -> Path:
    rng = np.random.default_rng(seed)
    alphabet = _bytes_to_unicode()
    merged, merges = _word_merges(alphabet, re.findall(r"[A-Za-z]+", RERANK_TEMPLATE) + WORDS)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = alphabet + merged + special
    types = [TokenType.NORMAL] * (len(alphabet) + len(merged)) + [TokenType.CONTROL] * len(special)
    n_vocab = len(tokens)

    w = _writer(path, "qwen3", "tiny-qwen3-reranker", n_ctx, n_embd, n_layer, n_ff, n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_pooling_type(PoolingType.RANK)
    w.add_classifier_output_labels(["yes", "no"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template([{"name": "default", "template": CHATML}, {"name": "rerank", "template": RERANK_TEMPLATE}])

    t = _random(w, rng, dtype)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", n_vocab, n_embd, scale=1.0)
    ones("output_norm.weight", n_embd)
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
    t("cls.output.weight", 2, n_embd, scale=0.3)
    _write(w)
    return path


WORDS = [  # whole words (single letters are in the alphabet below)
    "the",
    "of",
    "is",
    "in",
    "and",
    "to",
    "what",
    "which",
    "city",
    "capital",
    "france",
    "paris",
    "germany",
    "berlin",
    "fruit",
    "banana",
    "yellow",
    "river",
]


def bert_reranker(
    path: Path,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_ctx: int = 512,
    n_ff: int = 128,
    n_head: int = 4,
    dtype: type = np.float32,
) -> Path:
    rng = np.random.default_rng(seed)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    punct = list(".,?!'\"-:;()")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    # llama.cpp's WordPiece marks a word's first piece with "▁" and its continuations plain (its converter's "##x": "x")
    tokens = special + ["▁" + t for t in WORDS + letters + punct] + letters
    types = [TokenType.CONTROL] * len(special) + [TokenType.NORMAL] * (len(tokens) - len(special))
    n_vocab = len(tokens)

    w = _writer(path, "bert", "tiny-bert-reranker", n_ctx, n_embd, n_layer, n_ff, n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(PoolingType.RANK)
    w.add_token_type_count(2)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_pad_token_id(0)
    w.add_unk_token_id(1)
    w.add_bos_token_id(2)  # [CLS]
    w.add_sep_token_id(3)
    w.add_mask_token_id(4)
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)

    t = _random(w, rng, dtype)

    def norm(name: str) -> None:
        w.add_tensor(f"{name}.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"{name}.bias", np.zeros(n_embd, dtype=np.float32))

    t("token_embd.weight", n_vocab, n_embd, scale=1.0)
    t("token_types.weight", 2, n_embd)
    t("position_embd.weight", n_ctx, n_embd)
    norm("token_embd_norm")
    for i in range(n_layer):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{part}.weight", n_embd, n_embd)
            t(f"blk.{i}.{part}.bias", n_embd, scale=0.01)
        norm(f"blk.{i}.attn_output_norm")
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.bias", n_ff, scale=0.01)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
        t(f"blk.{i}.ffn_down.bias", n_embd, scale=0.01)
        norm(f"blk.{i}.layer_output_norm")
    t("cls.weight", n_embd, n_embd, scale=0.3)
    t("cls.bias", n_embd, scale=0.01)
    t("cls.output.weight", 1, n_embd, scale=1.0)
    t("cls.output.bias", 1, scale=0.01)
    _write(w)
    return path


def _write(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MAKERS = {"qwen3": qwen3_reranker, "bert": bert_reranker}

if __name__ == "__main__":
    MAKERS[sys.argv[1]](Path(sys.argv[2]))
