"""One sampler per job: the logits row of a batch row -> a token (and, when asked, its log-probability).

Order, as in llama.cpp: the grammar's mask (worker/guide.py), then penalties, logit_bias, top_k, top_p, min_p,
temperature, and the draw (greedy at temperature 0). Greedy without penalties is an argmax over the row in numpy
(first maximum, as llama's greedy sampler picks): ten times cheaper than the C chain, which copies all 262k
logits into a candidate array per token. A draw at a temperature with no penalties, top_k, top_p or min_p (what
OpenAI and Anthropic clients send unless told otherwise) is llama.cpp's temperature and dist samplers done in numpy
(`Draw`): the same token for the same seed, about six times cheaper. Everything else is a llama sampler chain.

Penalties (presence, frequency, repeat over the last `repeat_last_n` generated tokens) are llama.cpp's own
sampler. Log-probabilities are those of the model (a log-softmax of the raw row, before penalties, biases and
grammar), with the top k alternatives.
"""

from __future__ import annotations

import ctypes
import secrets
from typing import Any

import llama_cpp
import numpy as np

from protocol import Sampling, TokenLogprob, TopLogprob, outside_vocab, vocab_message
from worker.guide import Guide

BAN = -100.0
MIN_LOGPROB = -9999.0  # OpenAI's floor: JSON has no -infinity
DRAW_BLOCK = 1024  # Draw's running sum goes block by block, then within the block it ends in
BELOW_ONE = float(np.nextafter(1.0, 0.0))  # libstdc++'s generate_canonical never returns 1.0


class SamplingError(ValueError):
    """Sampling parameters this model cannot honour (e.g. a logit_bias token outside the vocabulary)."""


class Sampler:
    """Owns one llama_sampler chain (when it needs one). `sample(ctx, row)` picks and accepts a token."""

    def __init__(
        self, params: Sampling, n_vocab: int, *, guide: Guide | None = None, max_gen: int = 4096, piece: Any = None
    ) -> None:
        self.n_vocab = n_vocab
        self.piece = piece or (lambda t: b"")  # token id -> bytes, for log-probabilities
        self.guide = guide
        self.logprobs = params.logprobs
        self.chain = None
        bias = params.logit_bias_ids()
        if (bad := outside_vocab(list(bias), n_vocab)) is not None:
            raise SamplingError(f"logit_bias: {vocab_message(bad, n_vocab)}")
        plain = not params.penalized and params.top_k == 0 and params.top_p >= 1.0 and params.min_p <= 0.0
        self.fast = params.temperature == 0.0 and not params.penalized
        self.draw = Draw(params.temperature, params.seed, n_vocab) if plain and not self.fast else None
        if self.fast or self.draw:
            self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            self.bias = np.array([-np.inf if b <= BAN else b for b in bias.values()], dtype=np.float32)
            return
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        try:
            self._build(params, n_vocab, max_gen)
        except Exception:
            self.free()
            raise

    def _add(self, smpl: object) -> None:
        llama_cpp.llama_sampler_chain_add(self.chain, smpl)  # the chain takes ownership

    def _build(self, p: Sampling, n_vocab: int, max_gen: int) -> None:
        if p.penalized:
            last_n = max_gen if p.repeat_last_n < 0 else p.repeat_last_n
            penalties = llama_cpp.llama_sampler_init_penalties(
                n_vocab, last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
            self._add(penalties)
        bias = p.logit_bias_ids()
        if bias:
            arr: Any = (llama_cpp.llama_logit_bias * len(bias))()  # fields take plain ints and floats
            for i, (tok, b) in enumerate(bias.items()):
                arr[i].token = tok
                arr[i].bias = -float("inf") if b <= BAN else b
            self._add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        if p.temperature == 0.0:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        if p.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            self._add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            self._add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(p.temperature))
        seed = llama_cpp.LLAMA_DEFAULT_SEED if p.seed is None else p.seed  # DEFAULT_SEED draws a random seed
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def sample(self, ctx: ctypes.c_void_p, row: int) -> tuple[int, TokenLogprob | None]:
        """Pick a token from batch row `row` (a chain's llama_sampler_sample also accepts it: never accept again).
        The grammar's mask is written into the row itself, which nothing reads afterwards."""
        ptr = llama_cpp.llama_get_logits_ith(ctx, row)
        if not ptr:
            raise RuntimeError(f"batch row {row} has no logits")
        row_logits = logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        top = None if self.logprobs is None else _log_softmax_top(logits, self.logprobs, self.piece)
        if self.guide is not None:
            self.guide.mask(logits)
        if self.fast or self.draw:
            if len(self.bias_ids):
                logits = logits.copy()
                logits[self.bias_ids] += self.bias
            tok = self.draw(logits) if self.draw else int(logits.argmax())
        else:
            tok = llama_cpp.llama_sampler_sample(self.chain, ctx, row)
        if self.guide is not None:
            self.guide.follow(tok)
        if top is None:
            return tok, None
        lse, best = top  # the chosen token's raw logit is intact: the mask only lowers tokens that cannot be chosen
        lp = max(float(row_logits[tok]) - lse, MIN_LOGPROB)
        return tok, TokenLogprob(token=tok, logprob=lp, piece=self.piece(tok), top=best)

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


class Draw:
    """llama.cpp's temperature sampler then its dist sampler (llama-sampler.cpp), token for token, in numpy: each
    logit divided by the temperature, p = expf(logit - max) in float32, and the first token at which the running
    double sum of p reaches the sum times a draw of std::uniform_real_distribution<double> over std::mt19937 seeded
    as llama.cpp seeds it (numpy's MT19937 is the same generator; the double takes two 32-bit outputs, as libstdc++
    does). No 262k-entry candidate array is built; the running sum goes block by block."""

    def __init__(self, temperature: float, seed: int | None, n_vocab: int) -> None:
        self.temperature = np.float32(temperature)
        self.bits = np.random.MT19937()
        legacy = np.random.RandomState(secrets.randbits(32) if seed is None else seed)  # init_genrand(seed), as C++
        self.bits.state = {"bit_generator": "MT19937", "state": legacy.get_state(legacy=False)["state"]}
        self.p = np.empty(n_vocab, dtype=np.float32)
        self.starts = np.arange(0, n_vocab, DRAW_BLOCK)

    def uniform(self) -> float:
        """std::uniform_real_distribution<double>(0, 1) over std::mt19937: generate_canonical<double, 53>."""
        low, high = (float(x) for x in self.bits.random_raw(2))
        return min((low + high * 2.0**32) / 2.0**64, BELOW_ONE)

    def __call__(self, logits: np.ndarray) -> int:
        p = np.divide(logits, self.temperature, out=self.p)
        p -= p.max()
        np.exp(p, out=p)
        target = self.uniform()
        blocks = np.cumsum(np.add.reduceat(p, self.starts, dtype=np.float64))
        target *= blocks[-1]
        b = min(int(np.searchsorted(blocks, target, side="left")), len(blocks) - 1)
        start = int(self.starts[b])
        run = np.cumsum(p[start : start + DRAW_BLOCK], dtype=np.float64)
        if b:
            run += blocks[b - 1]
        return start + min(int(np.searchsorted(run, target, side="left")), len(run) - 1)  # (the last if none)


def _log_softmax_top(logits: np.ndarray, k: int, piece: Any) -> tuple[float, list[TopLogprob]]:
    """log-sum-exp of the row, and its k most likely tokens with their log-probabilities (most likely first)."""
    peak = float(logits.max())
    lse = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    if k == 0:
        return lse, []
    ids = np.argpartition(logits, -k)[-k:]
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    return lse, [TopLogprob(token=int(t), logprob=max(float(logits[t]) - lse, MIN_LOGPROB), piece=piece(int(t))) for t in ids]
