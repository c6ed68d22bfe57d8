"""`kvroute complete`, `kvroute chat`, `kvroute status`: talk to a running router over its ZMQ client socket."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvroute.client import DEFAULT_ENDPOINT, Client, KvrouteError
from protocol import Result, StatusReply


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connect",
        default=DEFAULT_ENDPOINT,
        metavar="ENDPOINT",
        help=f"the router's client endpoint (default: {DEFAULT_ENDPOINT}, or $KVROUTE_ENDPOINT)",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="give up when the router is silent this long (default: 10)"
    )
    parser.add_argument(
        "--curve-key",
        default=os.environ.get("KVROUTE_CURVE_KEY"),
        metavar="FILE",
        help="this client's CurveZMQ key file, for a router started with --client-keys ($KVROUTE_CURVE_KEY)",
    )
    parser.add_argument(
        "--router-key",
        default=os.environ.get("KVROUTE_ROUTER_KEY"),
        metavar="FILE",
        help="the router's public key file, NAME.pub ($KVROUTE_ROUTER_KEY)",
    )
    parser.add_argument(
        "--cache-salt",
        default=os.environ.get("KVROUTE_CACHE_SALT"),
        metavar="SALT",
        help="the tenant: cached prefixes are shared only with requests of the same salt; status shows its slots in "
        "full ($KVROUTE_CACHE_SALT)",
    )


def _sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    parser.add_argument("--min-p", type=float, default=0.0, help="(default: 0.0)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--usage", action="store_true", help="print usage and timings to stderr at the end")


def add_complete_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    _common(parser)
    _sampling(parser)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("message", nargs="?", help="one user message; without it, an interactive chat on the terminal")
    parser.add_argument("--system", default=None, help="a system message")
    _common(parser)
    _sampling(parser)


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "cache_salt": args.cache_salt,
    }


def _stream_out(client: Client, args: argparse.Namespace, **request: Any) -> Result:
    stream = client.stream(**request, **_sampling_kwargs(args))
    try:
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.cancel()
        raise
    sys.stdout.write("\n")
    assert stream.result is not None
    if args.usage:
        r = stream.result
        u, t = r.usage, r.timings
        print(
            f"[{r.finish_reason}] worker={r.worker} slot={r.slot} prompt={u.prompt_tokens} cached={u.cached_tokens} "
            f"completion={u.completion_tokens} ttft={t.ttft_ms:.0f}ms total={t.total_ms:.0f}ms",
            file=sys.stderr,
        )
    return stream.result


def _client(args: argparse.Namespace) -> Client:
    """The ZMQ client the flags describe; a bad key setup is a one-line usage error."""
    from common.config import UsageError

    try:
        return Client(args.connect, timeout_s=args.timeout, curve_key=args.curve_key, router_key=args.router_key)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _fail(exc: Exception, args: argparse.Namespace) -> int:
    if isinstance(exc, TimeoutError):
        print(f"kvroute: error: cannot reach the router at {args.connect} (no reply in {args.timeout:g} s)", file=sys.stderr)
    else:
        print(f"kvroute: error: {exc}", file=sys.stderr)
    return 1


def run_complete(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with _client(args) as client:
        try:
            _stream_out(client, args, prompt=prompt)
        except (KvrouteError, TimeoutError) as exc:
            return _fail(exc, args)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    with _client(args) as client:
        try:
            if args.message is not None:
                _stream_out(client, args, messages=[*history, {"role": "user", "content": args.message}])
                return 0
            while True:  # interactive: each turn resends the history, which the router finds cached
                try:
                    line = input("> ")
                except EOFError:
                    return 0
                if not line.strip():
                    continue
                history.append({"role": "user", "content": line})
                result = _stream_out(client, args, messages=history)
                history.append({"role": "assistant", "content": result.text})
        except (KvrouteError, TimeoutError) as exc:
            return _fail(exc, args)


def format_status(st: StatusReply) -> str:
    lines = [f"model {st.model}   policy {st.policy}   queued {st.queued}   workers {len(st.workers)}", ""]
    if len(st.models) > 1:  # several models: where each is loaded
        for m in st.models:
            keep = "kept" if m.keep_alive_s < 0 else f"keep-alive {m.keep_alive_s:g} s"
            names = m.name + (f" ({', '.join(m.aliases)})" if m.aliases else "")
            memory = f"{m.memory_mb:.0f} MiB" if m.memory_mb else "-"
            lines.append(
                f"  {names:<28} {m.state:<9} {'pinned' if m.pinned else keep:<18} {memory:>9}  {' '.join(m.workers) or '-'}"
            )
            lines += [f"    failed: {m.reason}"] if m.reason else []
        lines.append("")
    header = (
        f"{'worker':<10} {'inc':>3} {'device':<8} {'state':<9} {'slot':>4} {'busy':<4} {'tokens':>7} {'reused':>8} {'idle s':>7}"
        "  request"
    )
    lines.append(header)
    lines.append("-" * len(header))
    for w in st.workers:
        for s in w.slots:
            lines.append(
                f"{w.worker:<10} {w.incarnation:>3} {w.device:<8} {w.state:<9} {s.slot:>4} {'yes' if s.busy else 'no':<4} "
                f"{'-' if s.other_tenant else s.n_tokens:>7} {s.reused_total:>8} {s.last_used_s:>7.1f}  "
                f"{'(another tenant)' if s.other_tenant else s.request_id or ''}"
            )
        if not w.slots:
            lines.append(f"{w.worker:<10} {w.incarnation:>3} {w.device:<8} {w.state:<9}")
    sizes = [f"{w.worker} {w.ctx_per_slot} tokens, {w.kv_bytes_per_slot / 2**20:.1f} MiB of KV" for w in st.workers]
    if sizes:
        lines += ["", "per slot: " + "; ".join(sizes)]
    lines += [f"FAILED worker {f.worker}: {f.reason}" for f in st.failed]
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            st = client.status(cache_salt=args.cache_salt)
        except (KvrouteError, TimeoutError) as exc:
            return _fail(exc, args)
    if args.json:
        import msgspec

        print(json.dumps(msgspec.to_builtins(st), indent=2))
    else:
        print(format_status(st))
    return 0
