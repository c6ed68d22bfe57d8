"""The sampler with the real model: penalties, log-probabilities, and grammars (llguidance), eager and lazy."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from worker_helpers import assert_slot_invariant, complete

from chat.grammar import constraint
from protocol import Constraint, JobDone, JobError, ResponseFormat, unpack_tokens

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "population"],
}


def test_penalties_change_greedy_output(fast_engine, vocab):
    prompt = vocab.tokenize("Once upon a time")
    # (seeded: computed the same way every time, so that greedy equals greedy bit for bit; unseeded, a reused prefix
    # may tip a near tie)
    plain = complete(fast_engine, prompt, max_tokens=16, seed=1)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repeat_penalty": 1.8}):
        penalised = complete(fast_engine, prompt, max_tokens=16, seed=1, **kw)
        assert isinstance(penalised.final, JobDone) and penalised.tokens != plain.tokens, kw
    # repeat_last_n 0 turns the penalties off: greedy output again
    again = complete(fast_engine, prompt, max_tokens=16, seed=1, frequency_penalty=2.0, repeat_last_n=0)
    assert again.tokens == plain.tokens


def test_logprobs_are_the_model_s_and_agree_with_greedy_choice(fast_engine, vocab):
    prompt = vocab.tokenize("The capital of France is")
    run = complete(fast_engine, prompt, max_tokens=6, logprobs=3)
    lps = [lp for d in run.deltas for lp in d.logprobs]
    assert [lp.token for lp in lps] == run.tokens
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0].token == lp.token  # greedy took the most likely token
        assert lp.logprob == pytest.approx(lp.top[0].logprob) and lp.logprob <= 0
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.piece == vocab.piece(lp.token)
    assert sum(math.exp(t.logprob) for t in lps[0].top) <= 1.0 + 1e-6
    assert all(not d.logprobs for d in complete(fast_engine, prompt, max_tokens=3).deltas)  # only when asked


def test_json_schema_output_validates(fast_engine, vocab):
    c = constraint(None, None, "auto", True, ResponseFormat(type="json_schema", schema=SCHEMA), None)
    run = complete(fast_engine, vocab.tokenize("A city and its population, as JSON:"), max_tokens=60, constraint=c)
    done = run.final
    assert isinstance(done, JobDone) and done.finish_reason == "stop", done
    jsonschema.validate(json.loads(done.text), SCHEMA)
    assert_slot_invariant(fast_engine, run)


def test_jobs_with_one_schema_compile_it_once_and_not_on_the_compute_thread(fast_engine, vocab):
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "city": {"type": "string", "maxLength": 19}}}  # (new)
    c = constraint(None, None, "auto", True, ResponseFormat(type="json_schema", schema=schema), None)
    grammars = fast_engine.guide_tokenizer.grammars
    before = grammars.compiles, grammars.hits, grammars.compiled_on["kvroute-engine"]
    for question in ("A city and its population, as JSON:", "Name a city and its population, as JSON:"):
        done = complete(fast_engine, vocab.tokenize(question), max_tokens=60, constraint=c).final
        assert isinstance(done, JobDone) and done.finish_reason == "stop", done
        jsonschema.validate(json.loads(done.text), schema)
    assert (grammars.compiles - before[0], grammars.hits - before[1]) == (1, 2)  # (each job found it compiled)
    assert grammars.compiled_on["kvroute-engine"] == before[2]  # compiled as the job came (submit), not on the engine


def test_a_grammar_that_does_not_compile_is_refused_before_a_slot(fast_engine, vocab):
    run = complete(fast_engine, vocab.tokenize("x"), constraint=Constraint(grammar="start: undefined_rule"))
    assert isinstance(run.final, JobError) and run.final.code == "bad_request" and run.final.slot == -1
    assert "grammar" in run.final.message


def test_lazy_constraint_holds_only_after_its_trigger(fast_engine, vocab):
    # the model writes freely; from its first "{" on (trigger included) it must write this object, then stop
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    c = Constraint(grammar=f"start: %json {json.dumps(schema)}\n", triggers=["{"])
    prompt = vocab.tokenize("Q: is water wet? Answer as JSON like {")
    brace = {str(t): 5.0 for t in vocab.tokenize("{", add_special=False)}  # (so that this small model opens one)
    done = complete(fast_engine, prompt, max_tokens=40, constraint=c, logit_bias=brace).final
    assert isinstance(done, JobDone), done
    text = done.text
    assert "{" in text, text
    assert json.loads(text[text.index("{") :]) in ({"ok": True}, {"ok": False})
    assert done.finish_reason == "stop"


def test_grammar_slot_does_not_disturb_its_neighbours(fast_engine, vocab):
    """A constrained job and a free one side by side: the free one's greedy output is what it is alone."""
    free_prompt = vocab.tokenize("Once upon a time")
    alone = complete(fast_engine, free_prompt, slot=0, max_tokens=12).tokens
    c = constraint(None, None, "auto", True, ResponseFormat(type="json_object"), None)
    from worker_helpers import start

    guided = start(fast_engine, vocab.tokenize("JSON:"), slot=1, max_tokens=30, constraint=c)
    beside = start(fast_engine, free_prompt, slot=0, max_tokens=12)
    guided.wait()
    beside.wait()
    assert isinstance(guided.final, JobDone) and isinstance(json.loads(guided.final.text), dict)
    # batched with another slot the kernels may differ in the last bits: compare the first tokens only
    assert unpack_tokens(beside.final.tokens)[:3] == alone[:3]


def test_a_job_that_cannot_start_fails_alone_and_the_worker_goes_on(fast_engine, vocab, monkeypatch):
    import worker.admission

    def broken(*args, **kwargs):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(worker.admission, "Sampler", broken)
    failed = complete(fast_engine, vocab.tokenize("hi"), max_tokens=2).final
    monkeypatch.undo()
    assert isinstance(failed, JobError) and failed.code == "internal" and failed.error_id and "exploded" in failed.message
    assert isinstance(complete(fast_engine, vocab.tokenize("hi"), max_tokens=2).final, JobDone)
