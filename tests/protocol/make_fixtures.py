"""Golden protocol fixtures and the field tables of protocol/PROTOCOL.md, both generated from protocol/.

    .venv/bin/python tests/protocol/make_fixtures.py          # rewrite tests/fixtures/protocol/* and the tables

Fixtures are fixed example values (deterministic bytes). Canonical fixtures are `protocol.encode(msg)`: every
field present, in declaration order, `type` and `v` first. `submit_minimal` is what a hand-written client in
another language sends (plain msgpack, defaults left out); it is the worked example in PROTOCOL.md.
The tables keep the "Meaning" cells already written in PROTOCOL.md; a new field gets an empty one, which
tests/protocol/test_spec.py refuses until someone writes it.
"""

from __future__ import annotations

import json
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import protocol as p  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "protocol"
SPEC = ROOT / "protocol" / "PROTOCOL.md"

# Which decoder takes each union; the direction names used in index.json and PROTOCOL.md.
UNIONS: dict[str, Any] = {
    "client_request": p.ClientRequest,
    "router_reply": p.RouterReply,
    "worker_to_router": p.WorkerToRouter,
    "router_to_worker": p.RouterToWorker,
    "direct_reply": p.codec.DirectReply,
}
DECODERS = {
    "client_request": p.client_request_decoder,
    "router_reply": p.router_reply_decoder,
    "worker_to_router": p.worker_to_router_decoder,
    "router_to_worker": p.router_to_worker_decoder,
    "direct_reply": p.direct_reply_decoder,
}

PROMPT_TOKENS = [2, 9259, 1902, 563]
GEN_TOKENS = [1437, 236764, 1]
FIRST = GEN_TOKENS[:1]
TIMINGS = p.Timings(queue_ms=1.5, prefill_ms=12.25, decode_ms=40.0, ttft_ms=14.0, total_ms=55.75)
SAMPLING = p.Sampling(
    max_tokens=16,
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    seed=42,
    logit_bias={"106": -100.0, "9259": 2.5},
    stop=["\n\n", "END"],
    ignore_eos=False,
)
SLOT_TOKENS = PROMPT_TOKENS + GEN_TOKENS[:-1]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# a 1x1 PNG of one red pixel: an image part holds the file's bytes as the client sent it
RED_PIXEL_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c49444154789c63f8cfc0000003010100c9fe92ef"
    "0000000049454e44ae426082"
)
LOGPROB = p.TokenLogprob(
    token=1437,
    logprob=-0.25,
    piece=b" Paris",
    top=[p.TopLogprob(token=1437, logprob=-0.25, piece=b" Paris"), p.TopLogprob(token=9259, logprob=-1.75, piece=b" Lyon")],
)


def job_done(job: str, **more: Any) -> p.JobDone:
    """The worked job_done: the prompt's 4 tokens (3 reused), 3 generated, the slot holding all but the last."""
    return p.JobDone(
        id=job,
        slot=2,
        finish_reason=p.FinishReason.STOP,
        text=" Paris.",
        tokens=p.pack_tokens(GEN_TOKENS),
        prompt_tokens=4,
        reused_tokens=3,
        prefilled_tokens=1,
        generated_tokens=3,
        slot_tokens=len(SLOT_TOKENS),
        slot_hash=p.token_hash(SLOT_TOKENS),
        timings=TIMINGS,
        **more,
    )


@dataclass(frozen=True)
class Example:
    name: str  # file stem
    direction: str  # key of UNIONS
    msg: p.Message
    tokens: dict[str, list[int]]  # field path -> the token ids its `bin` holds
    raw: dict[str, Any] | None = None  # hand-written map (not canonical) packed with plain msgpack


EXAMPLES: list[Example] = [
    # ---- client -> router
    Example(
        "submit",
        "client_request",
        p.Submit(
            id="req-1",
            prompt="The capital of France is",
            sampling=SAMPLING,
            stream=True,
            deadline_ms=30000,
            model="gemma-3-270m",
            keep_alive_s=300.0,
        ),
        {},
    ),
    Example(
        "submit_messages",
        "client_request",
        p.Submit(
            id="req-2",
            messages=[
                p.ChatMessage(role="system", content="Answer in one word."),
                p.ChatMessage(role="user", content="Capital of France?"),
            ],
            sampling=p.Sampling(max_tokens=None, temperature=0.0),
            stream=False,
        ),
        {},
    ),
    Example(
        "submit_tokens",
        "client_request",
        p.Submit(id="req-3", tokens=p.pack_tokens(PROMPT_TOKENS), sampling=p.Sampling(max_tokens=8, seed=7)),
        {"tokens": PROMPT_TOKENS},
    ),
    Example(
        "submit_minimal",
        "client_request",
        p.Submit(id="r1", tokens=p.pack_tokens([2, 9259]), sampling=p.Sampling(max_tokens=4, temperature=0.0), stream=False),
        {"tokens": [2, 9259]},
        raw={
            "type": "submit",
            "v": 1,
            "id": "r1",
            "tokens": p.pack_tokens([2, 9259]),
            "sampling": {"max_tokens": 4, "temperature": 0},
            "stream": False,
        },
    ),
    Example(
        "submit_tools",
        "client_request",
        p.Submit(
            id="req-6",
            messages=[
                p.ChatMessage(role="user", content=[p.TextPart(text="Weather in Paris?")]),
                p.ChatMessage(
                    role="assistant",
                    content=None,
                    tool_calls=[p.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
                ),
                p.ChatMessage(role="tool", content='{"temp_c": 21}', tool_call_id="call_1"),
            ],
            tools=[p.Tool(name="get_weather", description="Current weather", parameters=WEATHER)],
            tool_choice=p.NamedTool(name="get_weather"),
            parallel_tool_calls=False,
            chat_template_kwargs={"enable_thinking": False},
            n=2,
            sampling=p.Sampling(max_tokens=64, temperature=0.0, presence_penalty=0.5, logprobs=2),
        ),
        {},
    ),
    Example(
        "submit_image",
        "client_request",
        p.Submit(
            id="req-8",
            messages=[
                p.ChatMessage(
                    role="user",
                    content=[p.TextPart(text="What colour is this?"), p.ImagePart(data=RED_PIXEL_PNG, detail="low")],
                ),
            ],
            sampling=p.Sampling(max_tokens=8, temperature=0.0),
        ),
        {},
    ),
    Example(
        "submit_json",
        "client_request",
        p.Submit(
            id="req-7",
            prompt="A city as JSON:",
            response_format=p.ResponseFormat(type="json_schema", schema=WEATHER, name="city"),
            sampling=p.Sampling(max_tokens=32),
        ),
        {},
    ),
    Example("cancel", "client_request", p.Cancel(id="req-1"), {}),
    Example(
        "tokenize",
        "client_request",
        p.Tokenize(
            id="tok-1",
            messages=[p.ChatMessage(role="user", content="Capital of France?")],
            tools=[p.Tool(name="get_weather", parameters=WEATHER)],
            with_pieces=True,
        ),
        {},
    ),
    Example("metrics", "client_request", p.MetricsRequest(id="m-1"), {}),
    Example("detokenize", "client_request", p.Detokenize(id="tok-2", tokens=p.pack_tokens(GEN_TOKENS)), {"tokens": GEN_TOKENS}),
    Example("status", "client_request", p.StatusRequest(id="st-1"), {}),
    Example(
        "submit_direct",
        "client_request",
        p.Submit(
            id="req-7",
            prompt="The capital of France is",
            sampling=p.Sampling(max_tokens=16),
            batch_deltas=True,
            reply_to="tcp://10.0.0.5:40123",
            reply_key=":{PE(6/3w8!5LZ<&#h13<+m^CHuSv<y{@!ZKkmS9",
        ),
        {},
    ),
    Example("embed", "client_request", p.Embed(id="emb-1", input=["The sea is calm.", "A lighthouse."], model="embedder"), {}),
    Example(
        "embed_tokens",
        "client_request",
        p.Embed(id="emb-2", tokens=[p.pack_tokens(PROMPT_TOKENS)], pooling="last", normalize=False),
        {},
    ),
    Example(
        "rerank",
        "client_request",
        p.Rerank(id="rr-1", query="Which city is the capital of France?", documents=["Paris is.", "Bananas are yellow."]),
        {},
    ),
    # ---- router -> client
    Example(
        "ranked",
        "router_reply",
        p.Ranked(id="rr-1", scores=[0.97, 0.02], prompt_tokens=180, worker="cpu0", cached_tokens=66),
        {},
    ),
    Example(
        "embeddings",
        "router_reply",
        p.Embeddings(id="emb-1", vectors=[bytes(16), bytes(16)], dims=4, prompt_tokens=9, worker="cpu0"),
        {},
    ),
    Example(
        "placed",
        "router_reply",
        p.Placed(
            id="req-7",
            job="req-7.3f9a2c1b.12",
            worker="gpu0",
            slot=2,
            format=p.ReplyFormat(family="hermes", tool_names=["get_weather"], reasoning=["<think>", "</think>"]),
            prompt_tokens=4,
            queue_ms=0.75,
        ),
        {},
    ),
    Example("delta", "router_reply", p.Delta(id="req-1", text=" Paris", tokens=p.pack_tokens(FIRST)), {"tokens": FIRST}),
    Example(
        "deltas",
        "router_reply",
        p.Deltas(
            items=[
                p.Delta(id="req-1", text=" Paris", tokens=p.pack_tokens(FIRST)),
                p.Delta(id="req-2", text=" Rome", tokens=p.pack_tokens(FIRST)),
            ]
        ),
        {},  # (the token ids are in each item's `tokens`)
    ),
    Example(
        "tokens",
        "router_reply",
        p.Tokens(id="tok-2", tokens=p.pack_tokens(FIRST), text=" Paris", pieces=[b" Paris"]),
        {"tokens": FIRST},
    ),
    Example(
        "metrics_reply",
        "router_reply",
        p.MetricsReply(
            id="m-1",
            text="# HELP kvroute_requests_waiting Requests waiting\n# TYPE kvroute_requests_waiting gauge\n"
            "kvroute_requests_waiting 0.0\n",
        ),
        {},
    ),
    Example(
        "delta_first",
        "router_reply",
        p.Delta(
            id="req-1",
            text=" Paris",
            tokens=p.pack_tokens(FIRST),
            usage=p.Usage(prompt_tokens=4, cached_tokens=3, completion_tokens=0),
        ),
        {"tokens": FIRST},
    ),
    Example(
        "delta_tool_call",
        "router_reply",
        p.Delta(
            id="req-6",
            index=1,
            text="",
            tokens=p.pack_tokens(FIRST),
            tool_calls=[p.ToolCallDelta(index=0, id="call_2", name="get_weather", arguments='{"city": "Paris"}')],
            logprobs=[LOGPROB],
        ),
        {"tokens": FIRST},
    ),
    Example(
        "result_tool_calls",
        "router_reply",
        p.Result(
            id="req-6",
            finish_reason=p.FinishReason.TOOL_CALLS,
            text="",
            tokens=p.pack_tokens(FIRST),
            usage=p.Usage(prompt_tokens=4, cached_tokens=3, completion_tokens=2),
            timings=TIMINGS,
            worker="w0",
            slot=1,
            reasoning="The user wants the weather.",
            tool_calls=[p.ToolCall(id="call_2", name="get_weather", arguments='{"city": "Paris"}')],
            logprobs=[LOGPROB],
            choices=[
                p.Choice(
                    index=0,
                    finish_reason="tool_calls",
                    text="",
                    tokens=p.pack_tokens(FIRST),
                    reasoning="The user wants the weather.",
                    tool_calls=[p.ToolCall(id="call_2", name="get_weather", arguments='{"city": "Paris"}')],
                    logprobs=[LOGPROB],
                    completion_tokens=1,
                ),
                p.Choice(index=1, finish_reason="length", text="Let me", tokens=p.pack_tokens(FIRST), completion_tokens=1),
            ],
        ),
        {"tokens": FIRST},
    ),
    Example(
        "result",
        "router_reply",
        p.Result(
            id="req-1",
            finish_reason=p.FinishReason.STOP,
            text=" Paris.",
            tokens=p.pack_tokens(GEN_TOKENS),
            usage=p.Usage(prompt_tokens=4, cached_tokens=3, completion_tokens=3),
            timings=TIMINGS,
            worker="w0",
            slot=2,
            stop="\n\n",
        ),
        {"tokens": GEN_TOKENS},
    ),
    Example(
        "error",
        "router_reply",
        p.Error(
            id="req-4",
            code=p.ErrorCode.QUEUE_FULL,
            message="queue is full (64 requests waiting)",
            error_id="e-7f3a",
            retry_after_ms=250,
        ),
        {},
    ),
    Example(
        "error_param",
        "router_reply",
        p.Error(
            id="req-8",
            code=p.ErrorCode.BAD_REQUEST,
            message="tool_choice names function 'get_time', which is not among the tools (get_weather)",
            param="tool_choice",
        ),
        {},
    ),
    Example(
        "error_overflow",
        "router_reply",
        p.Error(
            id="req-9",
            code=p.ErrorCode.CONTEXT_OVERFLOW,
            message="prompt of 4100 tokens + max_tokens 16 does not fit a slot of 4096 tokens",
            overflow=p.Overflow(prompt_tokens=4100, max_tokens=16, context=4096),
        ),
        {},
    ),
    Example(
        "status_reply",
        "router_reply",
        p.StatusReply(
            id="st-1",
            model="gemma-3-270m",
            policy="longest_prefix",
            queued=1,
            workers=[
                p.WorkerStatus(
                    worker="w0",
                    incarnation=3,
                    device="cpu",
                    state="ready",
                    queue=0,
                    slots=[
                        p.SlotStatus(slot=0, busy=True, n_tokens=120, request_id="req-1", reused_total=900, last_used_s=0.0),
                        p.SlotStatus(slot=1, busy=False, n_tokens=0, request_id=None, reused_total=0, last_used_s=12.5),
                    ],
                    restarts=1,
                    ctx_per_slot=4096,
                    kv_bytes_per_slot=37748736,
                )
            ],
            failed=[
                p.FailedWorker(
                    worker="w1",
                    reason="the worker's llama.cpp crashed (signal 11) in its first decode on this CPU; it crashed at"
                    " start 3 times, so it is not started again. What to try: rebuild it for this CPU",
                )
            ],
            models=[
                p.ModelStatus(
                    name="gemma-3-270m", aliases=["small"], state="loaded", workers=["w0"], pinned=True, memory_mb=291.5
                ),
                p.ModelStatus(name="coder", state="unloaded", keep_alive_s=600.0),
            ],
        ),
        {},
    ),
    # ---- worker -> router
    Example(
        "hello",
        "worker_to_router",
        p.Hello(
            worker_id="w0",
            incarnation=3,
            slots=4,
            ctx_per_slot=4096,
            model_fingerprint="9f86d081884c7d65",
            device="cpu",
            kv_bytes=150994944,
            n_batch=512,
            deterministic=True,
            pid=4242,
            weights_fingerprint="f24a794ded70f117",
            held=[p.SlotHeld(slot=0, tokens=p.pack_tokens([2, 9259, 1010]), n_exact=3), p.SlotHeld(slot=1, tokens=b"")],
            cached=[
                p.CacheEntry(
                    id=11,
                    n_tokens=3,
                    hash=p.token_hash([2, 9259, 77]),
                    nbytes=55296,
                    tokens=p.pack_tokens([2, 9259, 77]),
                ),
                p.CacheEntry(
                    id=4,
                    tier="disk",
                    salt="5d41402abc4b2a76b9719d91",
                    n_tokens=2,
                    hash=p.token_hash([2, 9259]),
                    nbytes=37264,
                    tokens=p.pack_tokens([2, 9259]),
                ),
            ],
        ),
        {},
    ),
    Example(
        "heartbeat",
        "worker_to_router",
        p.Heartbeat(
            worker_id="w0",
            incarnation=3,
            slots=[p.SlotState(slot=0, busy=True, n_tokens=6, job_id="req-1"), p.SlotState(slot=1, busy=False, n_tokens=0)],
            queue=2,
            draining=False,
            counters=p.EngineCounters(generated_tokens=1200.0, prefilled_tokens=5400.0, host_cache_bytes=1048576.0),
            progress=4821,
        ),
        {},
    ),
    Example(
        "job_delta",
        "worker_to_router",
        p.JobDelta(id="req-1", text=" Paris", tokens=p.pack_tokens(FIRST), logprobs=[LOGPROB], reused_tokens=3),
        {"tokens": FIRST},
    ),
    Example(
        "job_deltas",
        "worker_to_router",
        p.JobDeltas(
            items=[
                p.JobDelta(id="req-1", text=" Paris", tokens=p.pack_tokens(FIRST)),
                p.JobDelta(id="req-2", text=" Rome", tokens=p.pack_tokens(FIRST)),
            ]
        ),
        {},  # (the token ids are in each item's `tokens`)
    ),
    Example(
        "job_done",
        "worker_to_router",
        job_done(
            "req-1",
            stop="\n\n",
            cache_added=[p.CacheEntry(id=12, n_tokens=5, hash=p.token_hash([2, 9259, 5, 6, 7]), nbytes=92160, slot=2)],
            cache_dropped=[11],
            disk_dropped=[4],
        ),
        {"tokens": GEN_TOKENS},
    ),
    Example(
        "job_error",
        "worker_to_router",
        p.JobError(
            id="req-5",
            code=p.ErrorCode.CONTEXT_OVERFLOW,
            message="prompt of 4100 tokens + max_tokens 16 > ctx_per_slot 4096",
            error_id=None,
            overflow=p.Overflow(prompt_tokens=4100, max_tokens=16, context=4096),
            slot=-1,
            slot_tokens=0,
            slot_hash="",
        ),
        {"tokens": []},
    ),
    Example("slot_taken", "worker_to_router", p.SlotTaken(slot=2, epoch=7), {}),
    Example(
        "slot_update",
        "worker_to_router",
        p.SlotUpdate(
            slot=2,
            epoch=7,
            tokens=p.pack_tokens(SLOT_TOKENS),
            n_exact=0,
            salt="",
            min_keep=0,
            cache_added=[p.CacheEntry(id=13, n_tokens=5, hash=p.token_hash([2, 9259, 5, 6, 7]), nbytes=92160, slot=2)],
            cache_dropped=[12],
        ),
        {"tokens": SLOT_TOKENS},
    ),
    Example("embed_done", "worker_to_router", p.EmbedDone(id="emb-1.3f9a2c1b.e1", vectors=[bytes(16)], dims=4, ms=12.5), {}),
    # ---- worker -> a client's reply_to (direct replies)
    Example("direct_job_start", "direct_reply", p.JobStart(id="req-7.3f9a2c1b.12"), {}),
    Example(
        "direct_job_delta",
        "direct_reply",
        p.JobDelta(id="req-7.3f9a2c1b.12", text=" Paris", tokens=p.pack_tokens(FIRST), reused_tokens=3),
        {"tokens": FIRST},
    ),
    Example(
        "direct_job_deltas",
        "direct_reply",
        p.JobDeltas(
            items=[
                p.JobDelta(id="req-7.3f9a2c1b.12", text=" Paris", tokens=p.pack_tokens(FIRST)),
                p.JobDelta(id="req-8.3f9a2c1b.13", text=" Rome", tokens=p.pack_tokens(FIRST)),
            ]
        ),
        {},
    ),
    Example(
        "direct_job_done",
        "direct_reply",
        job_done("req-7.3f9a2c1b.12"),
        {"tokens": GEN_TOKENS},
    ),
    Example(
        "direct_error",
        "direct_reply",
        p.Error(
            id="req-7.3f9a2c1b.12",
            code=p.ErrorCode.ROUTER_LOST,
            message="the router that placed this request restarted and forgot it; its output stopped here",
        ),
        {},
    ),
    # ---- router -> worker
    Example(
        "embed_job",
        "router_to_worker",
        p.EmbedJob(id="emb-1.3f9a2c1b.e1", inputs=[p.pack_tokens(PROMPT_TOKENS)], pooling="mean"),
        {},
    ),
    Example(
        "accept",
        "router_to_worker",
        p.Accept(worker_id="w0", router_id="r-5f2c", features=["job_deltas", "slot_notices"]),
        {},
    ),
    Example(
        "refuse",
        "router_to_worker",
        p.Refuse(code=p.ErrorCode.MODEL_MISMATCH, reason="model fingerprint 9f86d081884c7d65 != router's 3a7bd3e2360a3d29"),
        {},
    ),
    Example(
        "job",
        "router_to_worker",
        p.Job(
            id="req-1",
            slot=2,
            tokens=p.pack_tokens(PROMPT_TOKENS),
            sampling=SAMPLING,
            deadline_ms=29990,
            predicted_reuse=3,
            prefix_cache=True,
            cache_salt="5d41402abc4b2a76b9719d91",
        ),
        {"tokens": PROMPT_TOKENS},
    ),
    Example(
        "job_constrained",
        "router_to_worker",
        p.Job(
            id="req-6.3",
            slot=1,
            tokens=p.pack_tokens(PROMPT_TOKENS),
            sampling=p.Sampling(max_tokens=64, temperature=0.0),
            predicted_reuse=0,
            constraint=p.Constraint(
                grammar='start: calls\ncalls: "<tool_call>" %json {"type": "object"} "</tool_call>"\n', triggers=["<tool_call>"]
            ),
        ),
        {"tokens": PROMPT_TOKENS},
    ),
    Example("job_cancel", "router_to_worker", p.JobCancel(id="req-1"), {}),
    Example(
        "state_fetch",
        "router_to_worker",
        p.StateFetch(id="req-7.r1.9", entry=12, tokens=p.pack_tokens(PROMPT_TOKENS)),
        {"tokens": PROMPT_TOKENS},
    ),
    Example(
        "state_copy",
        "worker_to_router",
        p.StateCopy(
            id="req-7.r1.9",
            state=p.StateBlob(
                tokens=p.pack_tokens(PROMPT_TOKENS),
                pos_min=0,
                data=b"\x01\x00\x00\x00state bytes as llama.cpp wrote them",
                checkpoints=[p.StateCheckpoint(n_tokens=4, data=b"window at 4")],
            ),
        ),
        {},  # (its token ids are inside `state`: bin, int32 little-endian, as every token field)
    ),
    Example("state_copy_gone", "worker_to_router", p.StateCopy(id="req-7.r1.9"), {}),
    Example("drain", "router_to_worker", p.Drain(), {}),
]


def frame_of(ex: Example) -> bytes:
    if ex.raw is not None:
        return msgpack.packb(ex.raw, use_bin_type=True)
    return p.encode(ex.msg)


def to_json(value: Any) -> Any:
    """A decoded msgpack value as JSON for index.json: `bin` becomes {"bin_hex": ...}."""
    if isinstance(value, bytes):
        return {"bin_hex": value.hex()}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def index() -> dict[str, Any]:
    out = {}
    for ex in EXAMPLES:
        frame = frame_of(ex)
        out[f"{ex.name}.msgpack"] = {
            "direction": ex.direction,
            "type": ex.msg.__struct_config__.tag,
            "canonical": ex.raw is None,
            "tokens": ex.tokens,
            "map": to_json(msgpack.unpackb(frame, raw=False)),
        }
    return out


# ---- field tables -------------------------------------------------------------------------------

ALL_STRUCTS: list[type[msgspec.Struct]] = [
    *[cls for union in UNIONS.values() for cls in typing.get_args(union)],
    p.Sampling,
    p.ReplyFormat,
    p.Usage,
    p.Timings,
    p.Overflow,
    p.ChatMessage,
    p.TextPart,
    p.ImagePart,
    p.JobImage,
    p.StateBlob,
    p.StateCheckpoint,
    p.ToolCall,
    p.Tool,
    p.NamedTool,
    p.ResponseFormat,
    p.TokenLogprob,
    p.TopLogprob,
    p.ToolCallDelta,
    p.Choice,
    p.SlotStatus,
    p.WorkerStatus,
    p.FailedWorker,
    p.ModelStatus,
    p.SlotState,
    p.EngineCounters,
    p.SlotHeld,
    p.CacheEntry,
    p.Constraint,
]


def _num(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 2**53 else str(x)


def type_name(t: mi.Type, field: str = "") -> str:
    if isinstance(t, mi.UnionType):
        return " or ".join(type_name(x, field) for x in t.types)
    if isinstance(t, mi.NoneType):
        return "nil"
    if isinstance(t, mi.AnyType):
        return "any"
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.IntType):
        return "int"
    if isinstance(t, mi.FloatType):
        return "float (int accepted)"
    if isinstance(t, mi.StrType):
        return "str"
    if isinstance(t, mi.LiteralType):
        return "str"
    if isinstance(t, mi.BytesType):
        return "bin (int32 LE token ids)" if field == "tokens" else "bin"
    if isinstance(t, mi.ListType):
        item = type_name(t.item_type)
        return f"array of ({item})" if isinstance(t.item_type, mi.UnionType) else f"array of {item}"
    if isinstance(t, mi.DictType):
        return f"map {type_name(t.key_type)} → {type_name(t.value_type)}"
    if isinstance(t, mi.StructType):
        return f"map ([{t.cls.__name__}](#{t.cls.__name__.lower()}))"
    raise TypeError(f"no wire name for {t!r}")


def constraints(t: mi.Type) -> list[str]:
    out: list[str] = []
    if isinstance(t, mi.UnionType):
        for x in t.types:
            out += constraints(x)
    elif isinstance(t, mi.IntType | mi.FloatType):
        low = f"≥ {_num(t.ge)}" if t.ge is not None else f"> {_num(t.gt)}" if t.gt is not None else None
        high = f"≤ {_num(t.le)}" if t.le is not None else f"< {_num(t.lt)}" if t.lt is not None else None
        if low and high:  # "0 ≤ x ≤ 1" / "0 < x ≤ 1"
            lo_op, lo_val = low.split(" ")
            out.append(f"{lo_val} {'≤' if lo_op == '≥' else '<'} x {high}")
        elif low or high:
            out.append(str(low or high))
    elif isinstance(t, mi.StrType):
        if t.min_length is not None or t.max_length is not None:
            out.append(f"length {t.min_length or 0}..{t.max_length if t.max_length is not None else ''}".rstrip("."))
    elif isinstance(t, mi.BytesType):
        if t.min_length is not None or t.max_length is not None:
            out.append(f"{t.min_length or 0}..{t.max_length if t.max_length is not None else ''} bytes".replace(".. ", "+ "))
    elif isinstance(t, mi.LiteralType):
        out.append("one of " + ", ".join(f'`"{v}"`' for v in t.values))
    elif isinstance(t, mi.ListType):
        out += [f"each item: {c}" for c in constraints(t.item_type)]
    elif isinstance(t, mi.DictType):
        out += [f"each value: {c}" for c in constraints(t.value_type)]
    return out


def default_text(f: mi.Field) -> str:
    if f.required:
        return "—"
    if f.default_factory is not msgspec.NODEFAULT:
        made = f.default_factory()
        if isinstance(made, msgspec.Struct):
            return "all defaults"
        return f"`{json.dumps(msgspec.to_builtins(made))}`"
    d = f.default
    if d is None:
        return "`nil`"
    if isinstance(d, bool):
        return "`true`" if d else "`false`"
    if isinstance(d, str):
        return f'`"{d}"`'
    return f"`{d!r}`"


TABLE_HEAD = "| Field | msgpack type | Required | Default | Constraints | Meaning |\n|---|---|---|---|---|---|"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def table(cls: type[msgspec.Struct], meanings: dict[str, str]) -> str:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    rows = [TABLE_HEAD]
    if info.tag_field:
        rows.append(f'| `type` | str | yes | — | `"{info.tag}"` | {meanings.get("type", "")} |')
    for f in info.fields:
        cons = ", ".join(constraints(f.type) + (["length a multiple of 4"] if f.name == "tokens" else []))
        if f.name == "v":
            cons = f"= {p.PROTOCOL_VERSION}"
            req = "yes"
            default = "—"
        else:
            req = "yes" if f.required else "no"
            default = default_text(f)
        rows.append(f"| `{f.name}` | {type_name(f.type, f.name)} | {req} | {default} | {cons} | {meanings.get(f.name, '')} |")
    return "\n".join(rows)


# (an empty block, a new struct's, is matched too: the body never runs past another table's markers)
BLOCK = re.compile(r"(<!-- table:(\w+) -->\n)((?:(?!<!-- /?table).)*?)(\n?<!-- /table -->)", re.S)


def existing_meanings(block: str) -> dict[str, str]:
    out = {}
    for line in block.splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = _cells(line)[-1]
    return out


def render_spec(text: str) -> str:
    """PROTOCOL.md with every `<!-- table:Name -->` block regenerated from the struct `Name`."""
    by_name = {cls.__name__: cls for cls in ALL_STRUCTS}

    def sub(m: re.Match[str]) -> str:
        cls = by_name[m.group(2)]
        return m.group(1) + table(cls, existing_meanings(m.group(3))) + "\n<!-- /table -->"

    return BLOCK.sub(sub, text)


def spec_tables(text: str) -> list[str]:
    return [m.group(2) for m in BLOCK.finditer(text)]


def main() -> int:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for ex in EXAMPLES:
        (FIXTURES / f"{ex.name}.msgpack").write_bytes(frame_of(ex))
    (FIXTURES / "index.json").write_text(json.dumps(index(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(EXAMPLES)} fixtures and index.json to {FIXTURES.relative_to(ROOT)}")
    if SPEC.exists():
        text = SPEC.read_text()
        new = render_spec(text)
        if new != text:
            SPEC.write_text(new)
            print(f"updated the field tables in {SPEC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
