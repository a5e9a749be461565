import pytest

from mlxkv.engine.memory.step_time import StepTime


def test_the_fit_recovers_fixed_per_token_and_per_attended_pair_costs():
    step_time = StepTime()
    assert step_time.seconds(10, 0) is None  # nothing measured yet
    for tokens, attended in [(1, 100), (4, 5000), (2, 300), (8, 20000), (1, 4000), (16, 900), (512, 10**6)]:
        step_time.record(tokens, attended, 0.010 + 0.001 * tokens + 2e-8 * attended)
    fixed, per_token, per_pair = step_time.coefficients
    assert (fixed, per_token, per_pair) == pytest.approx((0.010, 0.001, 2e-8), rel=1e-3)
    assert step_time.seconds(10, 10**6) == pytest.approx(0.040, rel=1e-3)


def test_steps_of_one_size_give_no_fit():
    step_time = StepTime()
    for _ in range(10):
        step_time.record(16, 16 * 300, 0.05)
    assert step_time.coefficients is None


def test_the_fit_follows_a_machine_that_slows_down():
    step_time = StepTime()
    for cost in (0.001, 0.002):
        for tokens in [1, 16, 4, 64, 2, 32] * 20:
            step_time.record(tokens, 0, 0.010 + cost * tokens)
    assert step_time.coefficients[1] == pytest.approx(0.002, rel=0.02)


def test_attended_pairs_that_fit_below_zero_are_left_out():
    """Noise that makes steps attending more come out a little faster: the fit keeps the fixed and
    per-token costs, and none per pair."""
    step_time = StepTime()
    for tokens, attended in [(1, 4000), (16, 100), (4, 3000), (64, 500), (2, 2000), (32, 800)] * 3:
        step_time.record(tokens, attended, 0.040 + 0.001 * tokens - 1e-8 * attended)
    fixed, per_token, per_pair = step_time.coefficients
    assert per_pair == 0.0
    assert fixed == pytest.approx(0.040, abs=0.001) and per_token == pytest.approx(0.001, rel=0.05)
