"""The numpy draw (worker/sampling.py `Draw`) against llama.cpp's own temperature + dist chain: the same token for the
same seed, draw after draw, on rows of many shapes."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from protocol import Sampling
from worker.sampling import Draw, Sampler

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


def chain_draws(logits: np.ndarray, temperature: float, seed: int, n: int) -> list[int]:
    """What llama.cpp's chain (temp, then dist) picks from `logits`, n times in a row (one RNG throughout)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
    fresh = np.zeros(len(logits), dtype=TOKEN_DATA)
    fresh["id"], fresh["logit"] = np.arange(len(logits)), logits
    data = (llama_cpp.llama_token_data * len(logits))()
    view = np.frombuffer(data, dtype=TOKEN_DATA)
    picks = []
    try:
        for _ in range(n):
            view[:] = fresh  # (the samplers write into the candidates)
            arr = llama_cpp.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
            picks.append(data[arr.selected].id)
    finally:
        llama_cpp.llama_sampler_free(chain)
    return picks


def row(n: int, scale: float, masked: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(n) * scale).astype(np.float32)
    logits[rng.random(n) < masked] = -np.inf  # a grammar's mask
    return logits


@pytest.mark.parametrize(
    ("n", "scale", "masked", "temperature", "seed"),
    [
        (262144, 3.0, 0.0, 1.0, 42),  # this model's vocabulary, a spread row
        (262144, 12.0, 0.0, 0.7, 7),  # a peaked row
        (262144, 1.0, 0.9, 1.5, 0),  # most tokens masked
        (5003, 2.0, 0.0, 0.2, 4294967294),  # a vocabulary that is no multiple of the block
        (3, 0.5, 0.0, 1.0, 11),
    ],
)  # fmt: skip
def test_the_numpy_draw_picks_what_llama_cpp_s_chain_picks_for_the_same_seed(n, scale, masked, temperature, seed):
    logits = row(n, scale, masked, seed % 1000)
    draw = Draw(temperature, seed, n)
    ours = [draw(logits) for _ in range(60)]
    assert ours == chain_draws(logits, temperature, seed, 60)
    assert len(set(ours)) > 1 or scale > 10  # (a row that gives more than one token: the draws are tested)


def test_a_sampler_draws_in_numpy_only_where_llama_cpp_s_chain_would_do_no_more():
    def mode(**kw: object) -> str:
        s = Sampler(Sampling(**kw), 1000)
        try:
            return "argmax" if s.fast else "draw" if s.draw else "chain"
        finally:
            s.free()

    assert mode(temperature=0.0) == "argmax"
    assert mode(temperature=0.8, seed=3) == mode(temperature=1.0, logit_bias={"5": 2.0}) == "draw"
    for kw in ({"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}, {"presence_penalty": 0.5}, {"repeat_penalty": 1.1}):
        assert mode(temperature=0.8, **kw) == "chain", kw


def test_an_unseeded_draw_differs_from_job_to_job():
    logits = row(4096, 1.0, 0.0, 1)
    firsts = {tuple(Draw(1.0, None, 4096)(logits) for _ in range(4)) for _ in range(5)}
    assert len(firsts) > 1
