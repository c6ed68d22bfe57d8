"""The cost model picks the expected slot in named scenarios."""

from __future__ import annotations

import itertools
import time

import numpy as np

from protocol import token_hash
from router.index import Match
from router.mirror import Mirror, Slot
from router.select import Dispatch, Params, Wait, WorkerLoad, select

_ids = itertools.count()
rng = np.random.default_rng(1)


def seq(n: int) -> np.ndarray:
    return rng.integers(10, 262_000, n).astype(np.int32)


def hold(m: Mirror, s: Slot, tokens: np.ndarray, age_s: float = 0.0) -> None:
    """Make slot `s` hold `tokens`, last used `age_s` ago, through the mirror's own path."""
    job = f"j{next(_ids)}"
    m.assign(s, job, tokens)
    assert m.finish(s, job, tokens, tokens[:0], len(tokens), token_hash(tokens.tolist())) is None
    s.last_used = time.monotonic() - age_s


def loads(m: Mirror, busy: dict[str, int] | None = None) -> list[WorkerLoad]:
    busy = busy or {}
    return [WorkerLoad(w, slots, busy=busy.get(w, 0)) for w, slots in m.workers.items()]


def pick(m: Mirror, prompt: np.ndarray, params: Params | None = None, rotation: int = 0, waited_ms: float = 0.0, busy=None):
    return select(m.index.match(prompt), loads(m, busy), params or Params(), time.monotonic(), rotation, waited_ms)


def test_hot_system_prompt_new_session_reuses_it_without_evicting_a_long_history():
    m = Mirror()
    w0 = m.add_worker("w0", 2)
    w1 = m.add_worker("w1", 2)
    system = seq(400)
    hold(m, w0[0], np.concatenate([system, seq(600)]))  # long conversation on the system prompt
    hold(m, w0[1], seq(300), age_s=3600)  # stale unrelated text
    hold(m, w1[0], np.concatenate([system, seq(40)]))  # short conversation on the system prompt
    hold(m, w1[1], seq(500))  # fresh unrelated text
    d = pick(m, np.concatenate([system, seq(30)]))
    assert isinstance(d, Dispatch)
    assert d.slot is w1[0] and d.reuse == 400 and d.affinity


def test_hot_system_prompt_is_not_evicted_by_a_cold_request():
    m = Mirror()
    (hot, stale) = m.add_worker("w0", 2)
    hold(m, hot, seq(800))
    hold(m, stale, seq(800), age_s=3600)
    d = pick(m, seq(100))
    assert isinstance(d, Dispatch) and d.slot is stale and d.reuse == 0 and not d.affinity


def test_more_sessions_than_slots():
    m = Mirror()
    slots = m.add_worker("w0", 2) + m.add_worker("w1", 2)
    histories = [seq(200) for _ in slots]
    for i, (s, h) in enumerate(zip(slots, histories, strict=True)):
        hold(m, s, h, age_s=100 - 10 * i)  # slot 0 least recently used
    # a returning session lands on its own slot even though its worker is the busier one
    d = pick(m, np.concatenate([histories[2], seq(20)]), busy={"w1": 1})
    assert isinstance(d, Dispatch) and d.slot is slots[2] and d.reuse == 200
    # a fifth, new session evicts the least recently used slot
    d = pick(m, seq(200), params=Params(evict_half_life_s=30))
    assert isinstance(d, Dispatch) and d.slot is slots[0]


def test_imbalance_guard_keeps_a_hot_worker_from_taking_everything():
    m = Mirror()
    w0 = m.add_worker("w0", 10)
    m.add_worker("w1", 10)
    history = seq(600)
    hold(m, w0[9], history)
    prompt = np.concatenate([history, seq(50)])
    # moderately busier: affinity wins
    d = pick(m, prompt, busy={"w0": 3})
    assert isinstance(d, Dispatch) and d.slot is w0[9]
    # 9 busy vs 0: the guard limits candidates to w1
    d = pick(m, prompt, busy={"w0": 9})
    assert isinstance(d, Dispatch) and d.slot.worker == "w1" and d.guarded


def test_ties_are_rotated_and_load_moves_at_dispatch():
    m = Mirror()
    for w in ("w0", "w1", "w2", "w3"):
        m.add_worker(w, 2)
    picked = [pick(m, seq(50), rotation=r).slot.worker for r in range(4)]  # type: ignore[union-attr]
    assert sorted(picked) == ["w0", "w1", "w2", "w3"]
    # cold requests spread as load counters move at dispatch
    busy: dict[str, int] = {}
    for r in range(8):
        d = pick(m, seq(50), rotation=r, busy=busy)
        assert isinstance(d, Dispatch)
        m.assign(d.slot, f"x{r}", seq(50))
        busy[d.slot.worker] = busy.get(d.slot.worker, 0) + 1
    assert busy == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}
    assert pick(m, seq(50)) is None  # no idle slot anywhere


def test_min_match_tiny_overlap_is_no_affinity():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    (b,) = m.add_worker("w1", 1)
    hold(m, a, np.concatenate([[2, 3, 4], seq(100)]))
    d = pick(m, np.concatenate([[2, 3, 4], seq(100)]), busy={"w0": 0})
    assert isinstance(d, Dispatch) and d.slot is b and not d.affinity


def test_full_match_backs_off_one_token():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    history = seq(100)
    hold(m, a, history)
    d = pick(m, history[:60])
    assert isinstance(d, Dispatch) and d.slot is a and d.reuse == 59


def test_busy_best_slot_waits_a_bounded_time():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    (b,) = m.add_worker("w1", 1)
    history = seq(300)
    hold(m, a, history)
    m.assign(a, "running", np.concatenate([history, seq(5)]))
    prompt = np.concatenate([history, seq(10)])
    d = pick(m, prompt, waited_ms=0, busy={"w0": 1})
    assert isinstance(d, Wait) and d.slot is a and d.reuse == 300
    d = pick(m, prompt, waited_ms=10_000, busy={"w0": 1})
    assert isinstance(d, Dispatch) and d.slot is b


def test_comparison_policies_ignore_prefixes_but_predict_reuse():
    m = Mirror()
    slots = m.add_worker("w0", 2) + m.add_worker("w1", 2)
    history = seq(100)
    hold(m, slots[0], history)
    rr = [pick(m, history, Params(policy="round-robin"), rotation=r).slot.worker for r in range(2)]  # type: ignore[union-attr]
    assert rr == ["w0", "w1"]
    d = pick(m, history, Params(policy="least-loaded"), busy={"w0": 1})
    assert isinstance(d, Dispatch) and d.slot.worker == "w1" and d.reuse == 0
    d = pick(m, np.concatenate([history, seq(3)]), Params(policy="round-robin"))
    assert isinstance(d, Dispatch) and d.slot in slots[:2] and d.reuse == (100 if d.slot is slots[0] else 0)


def test_prefix_cache_off_predicts_no_reuse():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    history = seq(100)
    hold(m, a, history)
    d = pick(m, history, Params(prefix_cache=False))
    assert isinstance(d, Dispatch) and d.reuse == 0


def brute_cost(s: Slot, lcp: int, length: int, load: float, p: Params, now: float) -> float:
    """The documented formula, written out once more for one slot."""
    reuse = 0 if s.dirty else min(lcp, length - 1)
    lost = 0 if s.dirty else len(s.tokens) - reuse
    return (
        length
        - (reuse if reuse >= p.min_match else 0)
        + load
        + p.evict_weight * lost * 0.5 ** ((now - s.last_used) / p.evict_half_life_s)
    )


def test_many_slots_on_one_shared_prefix_pick_the_formula_minimum():
    m = Mirror()
    system = seq(300)
    for w in range(6):
        for s in m.add_worker(f"w{w}", 10):
            hold(m, s, np.concatenate([system, seq(int(rng.integers(1, 400)))]), age_s=float(rng.uniform(0, 300)))
    busy = {f"w{w}": int(rng.integers(0, 3)) for w in range(6)}
    prompt = np.concatenate([system, seq(50)])
    p = Params()
    now = time.monotonic()
    d = select(m.index.match(prompt), loads(m, busy), p, now, 0, 0.0)
    assert isinstance(d, Dispatch)
    costs = [brute_cost(s, 300, len(prompt), p.busy_slot_cost * busy[s.worker], p, now) for s in m.slots()]
    assert abs(d.cost - min(costs)) < 1e-6 and d.reuse == 300


def test_a_just_finished_slot_is_held_for_its_conversation():
    held = Params(hold_ms=3000.0)
    m = Mirror()
    (a, b) = m.add_worker("w0", 2)
    history = seq(200)
    hold(m, a, history)  # just finished
    m.assign(b, "running", seq(100))
    # an unrelated request does not overwrite the held slot at once: it waits, then takes it
    d = pick(m, seq(80), held, busy={"w0": 1})
    assert isinstance(d, Wait) and d.slot is a and d.reuse == 0
    d = pick(m, seq(80), Params(hold_ms=0), busy={"w0": 1})
    assert isinstance(d, Dispatch) and d.slot is a
    # the conversation's own next turn takes it immediately
    d = pick(m, np.concatenate([history, seq(10)]), held, busy={"w0": 1})
    assert isinstance(d, Dispatch) and d.slot is a and d.reuse == 200
    # and a free slot elsewhere is used rather than waiting
    (c,) = m.add_worker("w1", 1)
    d = pick(m, seq(80), held, busy={"w0": 1})
    assert isinstance(d, Dispatch) and d.slot is c
    # once the hold has passed the slot is an ordinary candidate
    m.assign(c, "other", seq(30))
    a.last_used -= held.hold_ms / 1000 + 1
    d = pick(m, seq(80), held, busy={"w0": 1, "w1": 1})
    assert isinstance(d, Dispatch) and d.slot is a


def test_the_saved_state_giving_most_is_the_one_a_scan_of_every_entry_finds():
    """`best_saved` walks the match's path instead of taking an LCP per entry: the same answer as the worker's scan
    (the most tokens given, then the fewest to copy, then host RAM before disk), entries that cannot be cut back
    (recurrent: min_keep = their length) with checkpoints (`cuts`) included."""
    from common.slots import restore_keep, reused
    from router.index import Index
    from router.mirror import Saved
    from router.select import best_saved

    rng = np.random.default_rng(3)
    stems = [rng.integers(100, 200, 40).astype(np.int32) for _ in range(3)]
    for trial in range(60):
        index, saved = Index(), {}
        for i in range(int(rng.integers(1, 12))):
            stem = stems[int(rng.integers(3))][: int(rng.integers(1, 40))]
            tokens = np.concatenate([stem, rng.integers(200, 300, int(rng.integers(0, 5))).astype(np.int32)])
            n = len(tokens)
            uncut = trial % 2 == 1
            cuts = tuple(sorted({int(c) for c in rng.integers(1, n + 1, int(rng.integers(0, 4)))})) if uncut else ()
            entry = Saved("w", ("ram" if i % 2 else "disk", i), tokens, nbytes=1, min_keep=n if uncut else 0, cuts=cuts)
            saved[entry.key] = entry
            index.insert(entry, tokens)
        other = Saved("x", ("ram", 99), stems[0], nbytes=1)  # another worker's entry: not a candidate
        index.insert(other, stems[0])
        prompt = np.concatenate([stems[trial % 3][: int(rng.integers(1, 40))], np.array([7, 8], dtype=np.int32)])
        match = index.match(prompt)

        def key(s: Saved, match: Match = match, length: int = len(prompt)) -> tuple[int, int, bool]:
            r = restore_keep(reused(match.lcp(s), length), len(s.tokens), s.min_keep, s.cuts)
            return r, -len(s.tokens), not s.on_disk

        top = max(saved.values(), key=key)
        want = (key(top)[0], top) if key(top)[0] else (0, None)
        gives, got = best_saved(match, saved, seeded=False)
        assert gives == want[0] and (got is None) == (want[1] is None)
        assert got is None or key(got) == key(top)


def saved_on(m: Mirror, worker: str, tokens: np.ndarray, nbytes: int = 18_000) -> None:
    """A state `worker` saved in host RAM, reported as the worker reports it."""
    from protocol import CacheEntry, pack_tokens

    entry = CacheEntry(id=next(_ids), n_tokens=len(tokens), hash=token_hash(tokens.tolist()), nbytes=nbytes * len(tokens))
    entry.tokens = pack_tokens(tokens)
    assert m.cache_changed(worker, [entry]) == []


def test_a_worker_that_saves_what_it_overwrites_restores_a_state_on_its_recently_used_slot():
    """Overwriting a slot's recent conversation costs its recompute, unless its worker saves it in host RAM first
    (Hello.host_cache_bytes): then only a restore later (`evict_share`), and the prompt goes where its state is."""
    m = Mirror()
    (running, recent) = m.add_worker("w0", 2)
    m.add_worker("w1", 2)
    hold(m, recent, seq(300))  # a conversation that just ended
    m.assign(running, "running", seq(50))
    history = seq(120)
    saved_on(m, "w0", np.concatenate([history, seq(8)]))
    prompt = np.concatenate([history, seq(40)])
    plain = select(m.index.match(prompt), loads(m, {"w0": 1}), Params(), time.monotonic(), 0, 0.0)
    assert isinstance(plain, Dispatch) and plain.slot.worker == "w1" and plain.reuse == 0  # 300 tokens to lose on w0
    keeping = loads(m, {"w0": 1})
    keeping[0].evict_share = 18_000 * 1e-6  # a token's KV bytes x the cost of restoring a byte
    d = select(m.index.match(prompt), keeping, Params(), time.monotonic(), 0, 0.0)
    assert isinstance(d, Dispatch) and d.slot is recent and d.restore and d.reuse == 120


def test_a_full_worker_holding_a_long_saved_prefix_is_waited_for_as_long_as_computing_it_takes():
    """The wait for a full worker's saved state lasts `busy_wait_ms`, or as long as computing what it would save
    takes on the idle choice's worker, whichever is longer (bounded by MAX_WAIT_MS)."""
    from router.select import MAX_WAIT_MS, wait_bound_ms

    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    m.add_worker("w1", 1)
    history = seq(2000)
    saved_on(m, "w0", history)
    m.assign(a, "running", seq(50))
    prompt = np.concatenate([history, seq(10)])
    ws = loads(m, {"w0": 1})
    ws[1].prefill_tps = 500.0  # 2,000 tokens there: 4 s
    for waited, waits in ((0, True), (3_000, True), (4_100, False)):
        d = select(m.index.match(prompt), ws, Params(), time.monotonic(), 0, waited)
        assert isinstance(d, Wait if waits else Dispatch), (waited, d)
    assert isinstance(d, Dispatch) and d.slot.worker == "w1" and d.reuse == 0
    assert wait_bound_ms(2000, WorkerLoad("y", [], busy=1, prefill_tps=500.0), Params()) == 8_000  # (slows its job too)
    here = WorkerLoad("x", [])
    assert wait_bound_ms(2000, here, Params()) == Params().busy_wait_ms  # (speed not measured yet)
    here.prefill_tps = 10.0
    assert wait_bound_ms(2, here, Params()) == Params().busy_wait_ms and wait_bound_ms(10**6, here, Params()) == MAX_WAIT_MS


def test_a_full_worker_is_waited_for_while_its_first_job_should_end_before_recomputing_would():
    """With what its jobs have left known (`frees_at`), the wait is decided by it: on while the holder's first job
    should end before computing the gain elsewhere would, past the plain bound if need be; not at all past
    `busy_wait_ms` when it ends later."""
    from router.select import worth_waiting

    here = WorkerLoad("idle", [], prefill_tps=500.0)  # 2,000 tokens: 4 s there
    now = time.monotonic()
    soon, late = WorkerLoad("soon", [], frees_at=now + 1.0), WorkerLoad("late", [], frees_at=now + 10.0)
    assert worth_waiting(2000, here, soon, Params(), 4_500, now)  # (past the 4 s bound: it frees in 1 s)
    assert not worth_waiting(2000, here, late, Params(), 600, now)  # (10 s to wait, 4 s to compute)
    assert worth_waiting(2000, here, late, Params(), 100, now)  # (busy_wait_ms first)
    overdue = WorkerLoad("overdue", [], frees_at=now - 1.0)  # a job past its estimate: the plain bound
    assert worth_waiting(2000, here, overdue, Params(), 3_000, now)
    assert not worth_waiting(2000, here, overdue, Params(), 4_100, now)
    assert not worth_waiting(2000, here, soon, Params(), 61_000, now)  # (MAX_WAIT_MS)


def test_a_full_workers_saved_state_is_copied_to_an_idle_worker_that_keeps_copies():
    """A conversation a full worker saved in host RAM goes to an idle worker with a copy of that state (router/
    state_copies.py) rather than waiting or computing it again there: when that worker has a host-RAM tier and the
    same slots, length and mode; not when its own states give as much, nor with --no-state-copies."""
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    m.add_worker("w1", 1)
    history = seq(2000)
    saved_on(m, "w0", history, nbytes=3_000)
    m.assign(a, "running", seq(50))
    prompt = np.concatenate([history, seq(10)])

    def placed(params: Params | None = None, **on_w1: object) -> Dispatch | Wait | None:
        ws = loads(m, {"w0": 1})
        ws[1].host_cache_bytes = 1 << 30
        for w in ws:
            w.ctx_per_slot = 8192
        for w in ws:
            w.saved = m.saved[w.worker]
        for k, v in on_w1.items():
            setattr(ws[1], k, v)
        return select(m.index.match(prompt), ws, params or Params(), time.monotonic(), 0, 0.0)

    d = placed()
    (saved,) = m.saved["w0"].values()
    assert isinstance(d, Dispatch) and d.slot.worker == "w1" and d.restore and d.copy_from is saved
    assert d.reuse == 2000 and d.without_copy == 0
    assert isinstance(placed(Params(state_copies=False)), Wait)  # (the full worker is waited for instead)
    assert isinstance(placed(host_cache_bytes=0), Wait)  # (no host-RAM tier to keep it in)
    assert isinstance(placed(host_cache_bytes=2000 * 3_000 - 1), Wait)  # (one too small for it)
    assert isinstance(placed(ctx_per_slot=2000), Wait)  # (its slots are shorter)
    assert isinstance(placed(slots=[*m.workers["w1"], *m.workers["w1"]]), Wait)  # (llama.cpp's state lists each slot's)
    assert isinstance(placed(deterministic=True), Wait)  # (n_exact means another thing there)
    saved_on(m, "w1", history[:1990], nbytes=30_000)  # w1's own state: 10 tokens less, at a restore's cost
    d = placed()
    assert isinstance(d, Dispatch) and d.copy_from is saved and d.reuse == 2000 and d.without_copy == 1990
    saved_on(m, "w1", history, nbytes=30_000)  # now as much: nothing to copy
    own = placed()
    assert isinstance(own, Dispatch) and own.slot.worker == "w1" and own.copy_from is None and own.reuse == 2000
