"""worker/pace.py, no model: a step's prefill budget is n_batch unless a job generates beside the prompts; then about
the target's worth of prompt tokens at the speed measured on earlier steps (which falls as a prompt grows), never
fewer than MIN_TOKENS nor more than n_batch; steps of few prompt tokens do not move the speed."""

from __future__ import annotations

from worker.pace import HURRY_S, HURRY_TARGET_S, MIN_TOKENS, PrefillPace, Urgency


def test_n_batch_until_a_job_generates_and_the_speed_is_known() -> None:
    pace = PrefillPace(512, 0.5)
    assert pace.budget(generating=True) == 512, "speed not measured yet"
    pace.measured(512, 1.0)
    assert pace.budget(generating=False) == 512, "nothing waits for the step"
    assert pace.budget(generating=True) == 256, "512 tokens/s: half a second's worth"


def test_the_budget_follows_a_prompt_growing_slower() -> None:
    pace = PrefillPace(512, 0.5)
    budgets = []
    for seconds in (1.0, 2.0, 3.5, 3.5, 3.5):  # (one 512-token chunk's time, deeper in a long prompt each step)
        pace.measured(512, seconds)
        budgets.append(pace.budget(generating=True))
    assert budgets == sorted(budgets, reverse=True) and budgets[0] == 256
    assert 512 / 3.5 * 0.5 <= budgets[-1] < 100, budgets  # (a moving average: near 73 tokens, half a second's worth)


def test_bounds_and_off() -> None:
    pace = PrefillPace(512, 0.5)
    pace.measured(40, 10.0)  # (4 tokens/s)
    assert pace.budget(generating=True) == MIN_TOKENS
    pace = PrefillPace(512, 0.5)
    pace.measured(512, 0.01)
    assert pace.budget(generating=True) == 512
    off = PrefillPace(512, 0.0)
    off.measured(512, 3.0)
    assert off.budget(generating=True) == 512
    small = PrefillPace(16, 0.5)
    small.measured(16, 10.0)
    assert small.budget(generating=True) == 16, "never more than n_batch"


def test_steps_of_few_prompt_tokens_do_not_move_the_speed() -> None:
    pace = PrefillPace(512, 0.5)
    pace.measured(MIN_TOKENS - 1, 0.001)
    pace.measured(0, 0.03)
    assert pace.tokens_per_s == 0


def test_a_step_holds_little_prompt_work_while_a_higher_priority_may_come_back() -> None:
    """Issue 65: an interactive turn that comes back waits for the step in flight; while one ran within HURRY_S,
    lower-priority steps hold HURRY_TARGET_S of prompt work, generating or not."""
    pace = PrefillPace(512, 1.5)
    pace.measured(512, 1.6)  # (320 tokens/s: 2 cores)
    assert pace.budget(generating=False) == 512 and pace.budget(generating=True) == 480
    assert pace.budget(generating=False, hurry=True) == int(320 * HURRY_TARGET_S)
    assert PrefillPace(512, 0.0).budget(generating=False, hurry=True) == 512, "pacing off: n_batch"
    urgency, t = Urgency(), 1000.0
    assert not urgency.hurry(0, t)
    urgency.ran(1, t)  # an interactive job ran
    assert urgency.hurry(0, t + 1) and urgency.hurry(-1, t + 1) and not urgency.hurry(1, t + 1)
    urgency.ran(0, t + 2)
    assert urgency.hurry(0, t + HURRY_S - 1) and not urgency.hurry(0, t + HURRY_S + 1), "it is gone after HURRY_S"
