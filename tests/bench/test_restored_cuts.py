"""bench/restored_cuts.py on llama-server's trace log (its lines as the pinned llama-server writes them): a state
restored from `--cache-ram` and cut below its end counts as inexact reuse when it is longer than the window, never
when it held every position, and the slot's later cuts count until its prompt is computed from the start."""

from __future__ import annotations

from bench.restored_cuts import audit

HEAD = "0.01.366.414 I print_info: n_swa                 = 512\n"


def picked(slot: int, *entries: tuple[int, int], better: tuple[int, int] | None = None) -> str:
    """The slot llama-server chose, the cached states it weighed (tokens, lcp), and the one it restored, if any."""
    out = [f"1.00.000.000 I slot get_availabl: id  {slot} | task -1 | selected slot by LRU, t_last = 1"]
    for n, lcp in entries:
        out.append(f"1.00.000.001 I srv          load:    - prompt with length {n:7d}, lcp = {lcp:7d}, "
                   f"f_keep = {lcp / n:.3f}, f_sim = {lcp / 700:.3f}")  # fmt: skip
    if better is not None:
        n, lcp = better
        found = f"found better prompt with f_keep = {lcp / n:.3f}, f_sim = {lcp / 700:.3f}"
        out.append(f"1.00.000.002 I srv          load:  - {found}")
    return "\n".join(out) + "\n"


def task(slot: int, task_id: int, prompt: int, computed: int, generated: int = 4) -> str:
    return (
        f"1.00.000.003 I slot launch_slot_: id  {slot} | task {task_id} | processing task, is_child = 0\n"
        f"1.00.000.004 I slot print_timing: id  {slot} | task {task_id} | prompt eval time =  100.00 ms / {computed:5d} tokens\n"
        f"1.00.000.005 I slot print_timing: id  {slot} | task {task_id} |        eval time =  100.00 ms / {generated:5d} tokens\n"
        f"1.00.000.006 I slot      release: id  {slot} | task {task_id} | stop processing: "
        f"n_tokens = {prompt + generated - 1}, truncated = 0\n"
    )  # fmt: skip


def test_a_restored_state_longer_than_the_window_cut_below_its_end_is_counted() -> None:
    log = HEAD + picked(0, (300, 8), (900, 600), better=(900, 600)) + task(0, 1, prompt=700, computed=100)
    got = audit(log)
    assert (got.window, got.requests, got.computed) == (512, 1, 100)
    assert (got.inexact, got.inexact_requests) == (600, 1), "600 reused of a 900-token state: holes below 388"


def test_a_whole_state_or_one_that_held_every_position_is_exact() -> None:
    whole = HEAD + picked(0, (600, 600), better=(600, 600)) + task(0, 1, prompt=700, computed=101)
    short = HEAD + picked(1, (400, 300), better=(400, 300)) + task(1, 2, prompt=700, computed=400)
    assert audit(whole).inexact == 0, "599 of a 600-token state: the cut leaves every position its next token needs"
    assert audit(short).inexact == 0, "a 400-token state held every position of its window layers"
    assert audit(whole.replace("n_swa                 = 512", "n_swa                 = 0")).window == 0


def test_the_slots_later_cuts_count_until_it_computes_a_prompt_from_the_start() -> None:
    log = (
        HEAD
        + picked(0, (900, 600), better=(900, 600))
        + task(0, 1, prompt=950, computed=50)  # 900 reused: the whole state, exact
        + task(0, 2, prompt=800, computed=300)  # cut to 500 in the same slot: below 899, inexact
        + task(0, 3, prompt=400, computed=400)  # from the start: the old positions are gone
        + task(0, 4, prompt=420, computed=20)  # cut to 400 of what it computed itself: exact
    )
    got = audit(log)
    assert (got.requests, got.inexact, got.inexact_requests) == (4, 500, 1)
