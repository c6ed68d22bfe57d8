"""One sampler per job: greedy at temperature 0, else a llama sampler chain of top_k/top_p/min_p/temperature and
a seeded draw.

logit_bias is applied first in every mode (-100 bans a token). Greedy is an argmax over the row's logits in numpy
(first maximum, as llama's greedy sampler picks): ten times cheaper than the C chain, which copies all 262k
logits into a candidate array per token, and that copy was most of the engine's time outside llama_decode.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import numpy as np

from protocol import Sampling

BAN = -100.0


class SamplingError(ValueError):
    """Sampling parameters this model cannot honour (e.g. a logit_bias token outside the vocabulary)."""


class Sampler:
    """Owns one llama_sampler chain. `sample(ctx, row)` applies it to a batch row's logits and accepts the token."""

    def __init__(self, params: Sampling, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.chain = None
        bias = params.logit_bias_ids()
        bad = [t for t in bias if t >= n_vocab]
        if bad:
            raise SamplingError(f"logit_bias token ids {bad[:5]} are outside the vocabulary (0..{n_vocab - 1})")
        self.greedy = params.temperature == 0.0
        if self.greedy:
            self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            self.bias = np.array([-np.inf if b <= BAN else b for b in bias.values()], dtype=np.float32)
            return
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        try:
            self._build(params, n_vocab)
        except Exception:
            self.free()
            raise

    def _add(self, smpl: object) -> None:
        llama_cpp.llama_sampler_chain_add(self.chain, smpl)  # the chain takes ownership

    def _build(self, p: Sampling, n_vocab: int) -> None:
        bias = p.logit_bias_ids()
        if bias:
            arr: Any = (llama_cpp.llama_logit_bias * len(bias))()  # fields take plain ints and floats
            for i, (tok, b) in enumerate(bias.items()):
                arr[i].token = tok
                arr[i].bias = -float("inf") if b <= BAN else b
            self._add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        if p.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            self._add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            self._add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(p.temperature))
        seed = llama_cpp.LLAMA_DEFAULT_SEED if p.seed is None else p.seed  # DEFAULT_SEED draws a random seed
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def sample(self, ctx: ctypes.c_void_p, row: int) -> int:
        """Pick a token from batch row `row` (llama_sampler_sample also accepts it: never accept again)."""
        if not self.greedy:
            return llama_cpp.llama_sampler_sample(self.chain, ctx, row)
        ptr = llama_cpp.llama_get_logits_ith(ctx, row)
        if not ptr:
            raise RuntimeError(f"batch row {row} has no logits")
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if len(self.bias_ids):
            logits = logits.copy()
            logits[self.bias_ids] += self.bias
        return int(logits.argmax())

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
