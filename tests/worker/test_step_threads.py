"""runner/step_threads.py: small CPU steps try one thread and all of them, then keep the faster
for their size, trying the other now and then; larger steps always take all threads."""

from __future__ import annotations

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
    chosen = _run(st, 1, {1: 0.010, 2: 0.006}, 64)
    assert chosen[:2] == [1, 2]  # each once first
    assert chosen[2:].count(1) == 64 // 8  # then the other every 8th step of the size
    assert st.summary()[1] == {1: 0.010, 2: 0.006}


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
