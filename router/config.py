"""Router configuration: one frozen dataclass; `kvroute router` flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import opt
from protocol import OPEN_MAX_TOKENS
from router.sampling_defaults import out_of_bounds

POLICIES = ["prefix", "round-robin", "least-loaded"]
CHAT_FORMATS = ["gemma", "chatml"]
QUEUE_ORDERS = ["shortest", "fifo"]
DEFAULT_CLIENT_ENDPOINT = "tcp://127.0.0.1:5555"


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = opt(
        None, "GGUF model whose vocabulary the router tokenizes with (default: bundled Gemma 3 270M)", metavar="PATH"
    )
    mmproj: str | None = opt(
        None,
        "the model's vision projector GGUF (llama-server's --mmproj): requests may send images, which the router places "
        "in the prompt with it and the workers encode (`serve` gives it to its workers); several models: each its "
        "`mmproj` in the models file",
        metavar="FILE",
    )
    client_endpoint: str = opt(
        DEFAULT_CLIENT_ENDPOINT,
        "endpoint bound for clients (ZMQ ROUTER); under `serve` with an API key and no CURVE client keys the default "
        "becomes an IPC socket only this user can reach",
        flag="--zmq",
        aliases=("--listen",),
    )
    worker_endpoint: str = opt("tcp://127.0.0.1:5556", "endpoint bound for workers (ZMQ ROUTER)", flag="--worker-endpoint")
    policy: str = opt(
        "prefix",
        "slot selection: 'prefix' = the cost model (longest prefix held, load, what a choice overwrites); the "
        "baselines ignore prefixes, as a load balancer in front of independent servers does: 'round-robin' = each "
        "request goes to the next worker in turn when it arrives and waits for that worker, 'least-loaded' = a freed "
        "slot takes the oldest waiting request (both: first come, first served; the worker still reuses what it holds)",
        choices=POLICIES,
    )
    chat_format: str = opt("gemma", "built-in chat format used when the GGUF has no chat template", choices=CHAT_FORMATS)
    chat_template: str | None = opt(
        None, "a Jinja chat template file, or a built-in name (gemma, chatml), used instead of the GGUF's", metavar="FILE|NAME"
    )
    generic_tools: bool = opt(
        False,
        "show tools to a model whose chat template has no tool-call syntax, in a generic JSON format (a system message "
        'describing them; replies constrained to `{"tool_calls": [...]}` or `{"response": "..."}`). Off: as '
        "llama-server does, such a model is not shown them (a hint, counted) unless the request requires a call "
        "(tool_choice `required` or a named function); `generic_tools` in the models file, per model",
    )
    prefix_cache: bool = opt(True, "reuse cached prefixes; --no-prefix-cache sends every job with a cleared slot")
    min_match: int = opt(16, "fewest matching prompt tokens before a slot's cached prefix counts as affinity")
    busy_slot_cost: int = opt(32, "cost of each busy slot on a worker, in prompt-token equivalents")
    evict_weight: float = opt(1.0, "weight of the cached tokens a choice would overwrite (0 = ignore evictions)")
    evict_half_life_s: float = opt(60.0, "a slot's overwrite cost halves for every this many idle seconds")
    imbalance_abs: int = opt(
        4, "imbalance guard: busy-slot gap (max - min) above which affinity is limited to lightly loaded workers"
    )
    imbalance_rel: float = opt(1.5, "imbalance guard: and max busy > this x min busy")
    busy_wait_ms: int = opt(
        500,
        "how long a request may wait for its best slot while that slot is busy, for a held slot, or for a worker with no "
        "idle slot that saved its conversation",
    )
    hold_ms: int = opt(
        0,
        "after a job a slot is held this long for its own conversation's next turn; others wait (--busy-wait-ms at most). "
        "Off by default: workers keep evicted contents in host RAM (--host-cache-mb), so holding only idles slots",
    )
    tool_wait_s: float = opt(
        60.0,
        "a request with a session (an agent's) whose reply is tool calls keeps its slot for its conversation's next turn "
        "this long, or twice its longest recent pause when longer (at most 600 s): others take that slot only when no "
        "other idle slot is left; 0 = off",
    )
    preempt: bool = opt(
        True,
        "a waiting request of a higher priority that finds no idle slot has a running job of a lower priority handed "
        "back (kept KV, placed again; one already streaming is suspended and resumed where it stopped): each request "
        "takes one slot so, and loses one at most",
    )
    state_copies: bool = opt(
        True,
        "a request whose conversation a busy worker saved in host RAM may go to an idle worker with a copy of that state "
        "(sent through the router) instead of computing its prefix again, where the copy costs less",
    )
    queue_order: str = opt(
        "shortest",
        "which waiting request takes a freed slot: 'shortest' = the least prompt left to compute after the longest "
        "prefix a slot or saved state of a worker with an idle slot holds (a 50-token turn does not wait behind a cold "
        "800-token prompt; one whose history is on the freed worker goes first), 'fifo' = the oldest (the only order of "
        "the baseline policies)",
    )
    queue_bound_ms: int = opt(
        3000, "with --queue-order shortest, a request waiting this long goes before every shorter one (nothing starves)"
    )
    context_shift: bool = opt(
        False,
        "a chat request whose prompt + max_tokens does not fit the largest slot of the ready workers is shortened "
        "instead of refused: the oldest messages after the leading system ones are dropped, whole (a tool call with its "
        "results; the last user message stays), until it fits. The reply says so: usage.context_shift "
        "{dropped_messages, dropped_tokens} in the OpenAI API, dropped_messages/dropped_tokens in the result. "
        "Without it such a request gets context_overflow",
    )
    max_tokens: int = opt(
        0,
        "server-side cap on the tokens one request generates: a request asking for more, or for no limit, gets this "
        "many and ends with finish reason 'length'; 0 = no cap",
    )
    default_max_tokens: int = opt(
        OPEN_MAX_TOKENS,
        "what a request that sets no output cap (Chat's max_tokens, Responses' max_output_tokens, Codex sends none) may "
        "generate before it ends with finish reason 'length' (llama-server's -n): one reply cannot hold a slot for its "
        "whole context; 0 = until the slot's context is full (llama-server's default)",
    )
    temp: float | None = opt(
        None,
        "the temperature of a request that sets none (llama-server's --temp; default: the model's GGUF "
        "general.sampling.temp, else llama-server's 0.8)",
    )
    top_k: int | None = opt(None, "the top_k of a request that sets none (default: the GGUF's, else 40; 0 = off)")
    top_p: float | None = opt(None, "the top_p of a request that sets none (default: the GGUF's, else 0.95)")
    min_p: float | None = opt(None, "the min_p of a request that sets none (default: the GGUF's, else 0.05)")
    repeat_penalty: float | None = opt(
        None, "the repeat_penalty of a request that sets none (default: the GGUF's penalty_repeat, else 1.0 = off)"
    )
    repeat_last_n: int | None = opt(
        None, "the tokens a request's penalties look back over when it sets none (default: the GGUF's, else 64)"
    )
    seed: int | None = opt(None, "the seed of a request that sets none, so that it repeats (default: a random one)")
    queue_size: int = opt(
        0,
        "most requests waiting for a slot; 0 = 256, or 4 x total slots when that is more (agents arrive in dozens)",
    )
    queue_share: float = opt(
        0.5,
        "most of the queue the requests of one owner (an API key, named by the HTTP API) may hold, waiting or being "
        "prepared, so that one key cannot fill it for everyone; 1: no share",
    )
    no_workers_grace_s: float = opt(20.0, "with no worker connected for this long, requests get no_workers")
    heartbeat_timeout_s: float = opt(
        10.0,
        "a worker silent for this long is dead (one that exits under `serve`, or restarts, is noticed at once; a busy"
        " CPU box can delay a worker's heartbeats by seconds)",
    )
    hung_after_s: float = opt(
        60.0,
        "a worker with jobs whose engine made no progress for this long is hung: it is treated as dead (and, when "
        "`serve` runs it, killed and restarted). Longer than the slowest single step (one prefill chunk)",
    )
    max_worker_deaths: int = opt(
        2, "a request whose worker died this many times while running it fails (a poison request) instead of moving on"
    )
    max_frame_bytes: int = opt(8 * 1024 * 1024, "largest client frame accepted")
    prepare_timeout_s: float = opt(
        10.0,
        "how long preparing one request (its template, tokenizing, schema and grammar work) may take on the router's "
        "preparing threads; a request that would take longer is refused (400) naming the field being prepared",
    )
    drain_timeout_s: float = opt(
        30.0, "on SIGTERM: new requests get `draining`; accepted ones get this long to finish, then an error"
    )
    alive_file: str | None = opt(
        None,
        "a file touched every few seconds by the router's event loop (as systemd's watchdog is pinged): a liveness "
        "probe where there is no systemd, e.g. Kubernetes (deploy/kubernetes)",
        metavar="FILE",
    )
    curve_key: str | None = opt(None, "the router's CurveZMQ key file (secret; `kvroute keys generate`)", metavar="FILE")
    client_keys: str | None = opt(
        None, "directory of client public keys (*.pub) allowed on the client socket; enables CURVE there", metavar="DIR"
    )
    worker_keys: str | None = opt(
        None, "directory of worker public keys (*.pub) allowed on the worker socket; enables CURVE there", metavar="DIR"
    )
    insecure_bind: bool = opt(False, "allow binding a non-loopback address without CURVE keys (logs a warning)")

    def sampling_flags(self) -> dict[str, float | int | None]:
        """The operator's sampling for requests that leave a field to the server, by the field's name in `Sampling`
        (None: not given; router/sampling_defaults.py adds the model's and llama-server's)."""
        return {
            "temperature": self.temp, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
            "repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n,
        }  # fmt: skip

    def __post_init__(self) -> None:
        for name, value in self.sampling_flags().items():
            if value is not None and (why := out_of_bounds(name, value)):
                flag = "temp" if name == "temperature" else name.replace("_", "-")
                raise ValueError(f"--{flag} {why}")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens must be 0 (no cap) or more, got {self.max_tokens}")
        if self.default_max_tokens < 0:
            raise ValueError(f"--default-max-tokens must be 0 (the slot's context) or more, got {self.default_max_tokens}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {self.chat_format!r}")
        if self.queue_order not in QUEUE_ORDERS:
            raise ValueError(f"queue_order must be one of {QUEUE_ORDERS}, got {self.queue_order!r}")
        if self.queue_bound_ms < 0:
            raise ValueError(f"queue_bound_ms must be at least 0, got {self.queue_bound_ms}")
        if self.min_match < 1:
            raise ValueError(f"min_match must be at least 1, got {self.min_match}")
        if self.heartbeat_timeout_s <= 0 or self.no_workers_grace_s < 0 or self.busy_wait_ms < 0 or self.hold_ms < 0:
            raise ValueError("timeouts must be positive")
        if self.tool_wait_s < 0:
            raise ValueError(f"tool_wait_s must be at least 0, got {self.tool_wait_s}")
        if self.hung_after_s <= 0:
            raise ValueError(f"hung_after_s must be positive, got {self.hung_after_s}")
        if self.max_worker_deaths < 1:
            raise ValueError(f"max_worker_deaths must be at least 1, got {self.max_worker_deaths}")
        if not 0 < self.queue_share <= 1:
            raise ValueError(f"queue_share must be in (0, 1], got {self.queue_share}")
        if self.prepare_timeout_s <= 0:
            raise ValueError(f"prepare_timeout_s must be positive, got {self.prepare_timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be at least 0, got {self.drain_timeout_s}")
