"""Grammar engines compared (run by hand): the cost of constraining one token over the model's whole vocabulary.

    .venv/bin/python -m bench.grammar_engines [--repeats 5]

For each token of a JSON document that follows a schema (a tool call's arguments), in one run:
- llguidance (what kvroute uses): compute the token mask (`fill_next_token_bitmask`) and apply it to the logits row;
- llama.cpp's grammar sampler (`llama_sampler_init_grammar`, the schema converted to GBNF by llama-cpp-python's
  `json_schema_to_gbnf`): `llama_sampler_apply` on a candidate array of the whole vocabulary, as a sampler chain
  does on a token the grammar rejects.
The vocabulary is the default model's: 262,144 tokens (Gemma 3).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from chat.grammar import json_rule
from common.model import resolve_model
from common.vocab import Vocab
from protocol import Constraint
from worker.guide import Guide, GuideTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "line": {"type": "integer"},
        "mode": {"enum": ["read", "write"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["path", "line", "mode"],
}
DOCUMENT = '{"path": "src/server/main.py", "line": 120, "mode": "write", "tags": ["fix", "urgent"]}'


def llguidance_ms(tokenizer: GuideTokenizer, tokens: list[int], logits: np.ndarray) -> list[float]:
    guide = Guide(Constraint(grammar="start: doc\n" + json_rule("doc", SCHEMA)), tokenizer)
    out = []
    for tok in tokens:
        row = logits.copy()
        t = time.perf_counter()
        guide.mask(row)
        out.append((time.perf_counter() - t) * 1000)
        guide.follow(tok)
    assert guide.matcher is not None and guide.matcher.is_accepting()
    return out


def llama_grammar_ms(vocab: Vocab, tokens: list[int], logits: np.ndarray) -> list[float]:
    gbnf = json_schema_to_gbnf(json.dumps(SCHEMA))
    sampler = llama_cpp.llama_sampler_init_grammar(vocab.pointer, gbnf.encode(), b"root")
    n = vocab.n_vocab
    cells = (llama_cpp.llama_token_data * n)()
    view = np.ctypeslib.as_array(ctypes.cast(cells, ctypes.POINTER(ctypes.c_uint8)), shape=(n * 12,))
    rows = view.view(np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
    out = []
    try:
        for tok in tokens:
            rows["id"], rows["logit"], rows["p"] = np.arange(n), logits, 0.0
            arr = llama_cpp.llama_token_data_array(cells, n, -1, False)
            t = time.perf_counter()
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
            out.append((time.perf_counter() - t) * 1000)
            llama_cpp.llama_sampler_accept(sampler, tok)
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    vocab = Vocab.load(resolve_model(None))
    tokenizer = GuideTokenizer(vocab)
    tokenizer.get()
    tokens = vocab.tokenize(DOCUMENT, add_special=False, parse_special=False)
    logits = np.random.default_rng(0).standard_normal(vocab.n_vocab).astype(np.float32)
    ours, theirs = [], []
    for _ in range(a.repeats):  # interleaved, so that machine noise hits both alike
        ours += llguidance_ms(tokenizer, tokens, logits)
        theirs += llama_grammar_ms(vocab, tokens, logits)
    tokenizer.close()
    q = statistics.quantiles
    print(f"{len(tokens)} tokens x {a.repeats} repeats, vocabulary {vocab.n_vocab}")
    for name, ms in (("llguidance mask + apply", ours), ("llama.cpp grammar apply", theirs)):
        print(f"{name}: mean {statistics.fmean(ms):7.3f} ms, p50 {statistics.median(ms):7.3f}, p99 {q(ms, n=100)[98]:7.3f}")
    print(f"ratio of means: llama.cpp / llguidance = {statistics.fmean(theirs) / statistics.fmean(ours):.0f}x")


if __name__ == "__main__":
    main()
