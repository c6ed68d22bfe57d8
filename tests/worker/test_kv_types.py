"""The KV cache's types and flash attention (`--cache-type-k/-v`, `--flash-attn`): impossible combinations stop
start-up naming the flag; a quantized cache serves with less memory and says how much."""

from __future__ import annotations

import pytest

from protocol import Job, JobDone, Sampling, pack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"cache_type_k": "q5_1"}, "--cache-type-k"),
        ({"cache_type_v": "q8_0", "flash_attn": "off"}, "--cache-type-v"),
        ({"cache_type_v": "q4_0", "deterministic": True}, "--cache-type-v"),
        ({"flash_attn": "on", "deterministic": True}, "--flash-attn"),
        ({"flash_attn": "sometimes"}, "--flash-attn"),
    ],
)
def test_impossible_kv_settings_are_refused_naming_the_flag(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        WorkerConfig(**fields)


@pytest.mark.model
def test_a_quantized_cache_serves_in_about_half_the_memory() -> None:
    sizes = {"slots": 1, "ctx_per_slot": 512, "threads": 2}
    kv, state = {}, {}
    for types in (("f16", "f16"), ("q8_0", "q8_0")):
        eng = Engine(WorkerConfig(**sizes, cache_type_k=types[0], cache_type_v=types[1], spec="none")).start()
        try:
            prompt = eng.vocab.tokenize("The three primary colours are red, yellow and")
            job = Job(id=f"kv-{types[0]}", slot=0, tokens=pack_tokens(prompt), sampling=Sampling(temperature=0.0, max_tokens=8))
            done = eng.submit(job).result(120)
            assert isinstance(done, JobDone) and done.generated_tokens == 8 and done.text.strip()
            kv[types] = eng.llama.info.kv_bytes
            state[types] = eng.call(lambda e: e.llama.state_size(0)).result(10)  # what llama.cpp really holds
        finally:
            eng.stop()
    assert kv[("q8_0", "q8_0")] == pytest.approx(kv[("f16", "f16")] * 34 / 64)
    assert state[("q8_0", "q8_0")] < 0.6 * state[("f16", "f16")]
