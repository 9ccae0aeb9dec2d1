"""runner/step_threads.py: small CPU steps try one thread and all of them, then keep the faster
for their size, trying the other now and then; larger steps always take all threads."""

from __future__ import annotations

from skyline.worker.runner import step_threads
from skyline.worker.runner.step_threads import StepThreads


def _run(st: StepThreads, tokens: int, seconds: dict[int, float], steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        n = st.choose(tokens)
        chosen.append(n)
        st.record(tokens, n, seconds[n])
    return chosen


def test_the_faster_choice_wins_and_the_other_is_retried():
    st = StepThreads(threads=2, small_tokens=4, explore_every=8)
    chosen = _run(st, 1, {1: 0.0061, 2: 0.006}, 66)
    assert chosen[:2] == [1, 2]  # each once first
    assert chosen[2:].count(1) == 64 // 8  # then the other every 8th step of the size
    assert st.summary()[1] == {1: 0.0061, 2: 0.006}


def test_a_much_slower_choice_is_retried_within_the_cost_budget():
    """One thread 10x slower (a large model on 16 cores): retried every ~300 steps, not every
    32, so the retries add at most EXPLORE_COST to the time."""
    seconds = {1: 0.250, 16: 0.025}
    st = StepThreads(threads=16, small_tokens=4, explore_every=32)
    chosen = _run(st, 1, seconds, 2 + 3000)
    retries = chosen[2:].count(1)
    assert 1 <= retries <= 10
    spent = sum(seconds[n] for n in chosen[2:])
    assert spent / (3000 * seconds[16]) - 1 <= step_threads.EXPLORE_COST + 1e-9
    # a choice only a little slower keeps the plain interval
    st = StepThreads(threads=16, small_tokens=4, explore_every=32)
    assert _run(st, 1, {1: 0.026, 16: 0.025}, 2 + 320)[2:].count(1) == 10


def test_a_change_of_load_moves_the_choice():
    st = StepThreads(threads=2, small_tokens=4, explore_every=4)
    _run(st, 2, {1: 0.010, 2: 0.006}, 16)  # idle machine: two threads
    # another process takes the second core: two threads stall, the retries see it
    chosen = _run(st, 2, {1: 0.010, 2: 0.030}, 40)
    assert chosen[-10:].count(1) >= 7


def test_sizes_are_measured_apart_and_large_steps_take_all_threads():
    st = StepThreads(threads=4, small_tokens=4)
    _run(st, 1, {1: 0.001, 4: 0.002}, 10)
    _run(st, 4, {1: 0.004, 4: 0.002}, 10)
    assert st.choose(1) == 1 and st.choose(4) == 4
    assert st.choose(5) == 4 and 5 not in st.summary()
    assert StepThreads(threads=1, small_tokens=4).choose(1) == 1
    assert StepThreads(threads=2, small_tokens=0).choose(1) == 2
