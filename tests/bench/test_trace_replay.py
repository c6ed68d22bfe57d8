"""bench/trace_replay.py without a server: the oracle's arithmetic on chains of blocks, equal blocks making equal
prompts, and how a reply's computed tokens are read (kvroute's usage, llama-server's timings)."""

from __future__ import annotations

from bench.trace_replay import Row, computed_of, oracle, output_of, prompt_of


def rows(*chains: tuple[int, ...]) -> list[Row]:
    return [Row(512 * len(c), 100, c) for c in chains]


def test_the_oracle_reuses_the_longest_chain_seen_and_no_more() -> None:
    got = oracle(rows((0, 1, 2), (0, 1, 3), (0, 4), (5, 1)))
    # (0,1,2) all computed; (0,1,3) reuses 2; (0,4) reuses 1; (5,1): block 1 was seen, but not after 5: computed
    assert (got.sent, got.computed) == (10, 3 + 1 + 1 + 2)


def test_a_budget_evicts_the_least_recently_used_blocks() -> None:
    trace = rows((0, 1), (2, 3), (0, 1))
    assert oracle(trace).computed == 4
    assert oracle(trace, budget_blocks=2).computed == 6, "(0, 1) was evicted by (2, 3)"
    assert oracle(trace, budget_blocks=4).computed == 4


def test_equal_blocks_make_equal_prompts_in_both_modes() -> None:
    a, b = Row(1024, 512, (7, 8)), Row(1024, 512, (7, 9))
    for mode in ("text", "tokens"):
        pa, pb = prompt_of(a, mode, 8), prompt_of(b, mode, 8)
        units_a, units_b = (pa.split(" "), pb.split(" ")) if isinstance(pa, str) and isinstance(pb, str) else (pa, pb)
        assert units_a != units_b and units_a[:8] == units_b[:8], mode
    assert len(prompt_of(a, "tokens", 8)) == 16 and len(str(prompt_of(a, "text", 8)).split()) == 16
    assert output_of(a, 8) == 8 and output_of(Row(512, 3, (1,)), 8) == 1


def test_computed_tokens_from_usage_or_llama_servers_timings() -> None:
    assert computed_of({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 60}}}) == (100, 40)
    assert computed_of({"usage": {"prompt_tokens": 100}, "timings": {"prompt_n": 25}}) == (100, 25)
    assert computed_of({"usage": {"prompt_tokens": 100}}) == (100, 100)


def test_smg_over_llama_servers_is_one_llama_server_per_worker_behind_the_gateway(monkeypatch) -> None:
    """The side-by-side runner's SGLang systems: `workers` llama-servers of `slots` slots and their share of the
    threads, each on its own port, and the gateway last (started once they answer) with the policy and every URL."""
    from bench.systems import SMG_POLICIES, Setup, commands

    monkeypatch.setenv("KVROUTE_LLAMA_SERVER", "/bin/llama-server")
    monkeypatch.setenv("KVROUTE_SMG", "/bin/smg")
    setup = Setup("model.gguf", threads=2, workers=2, slots=2, ctx_per_slot=8192)
    for name, policy in SMG_POLICIES.items():
        *servers, gateway = commands(name, setup, 9000)
        assert len(servers) == 2 and all(argv[0] == "/bin/llama-server" for argv in servers)
        ports = [argv[argv.index("--port") + 1] for argv in servers]
        assert len(set(ports)) == 2 and "9000" not in ports
        for argv in servers:
            assert argv[argv.index("--parallel") + 1] == "2" and argv[argv.index("--ctx-size") + 1] == "16384"
            assert argv[argv.index("--threads") + 1] == "1" and "--swa-full" in argv
        assert gateway[:2] == ["/bin/smg", "launch"] and gateway[gateway.index("--policy") + 1] == policy
        assert gateway[gateway.index("--port") + 1] == "9000"
        assert gateway[gateway.index("--worker-urls") + 1 :][:2] == [f"http://127.0.0.1:{p}" for p in ports]


def test_the_token_oracle_reuses_the_longest_shared_prefix_less_the_last_token() -> None:
    from bench.trace_replay import token_oracle

    got = token_oracle([[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 3, 4], [7]])
    # 4 computed; 3 reused of 5 (2 computed); all 4 shared, the last computed again (1); 1 computed
    assert (got.sent, got.computed) == (14, 4 + 2 + 1 + 1)
