"""The step trace (engine/step_trace.py): steps by kind, the host's waits, and the Triton
compilations a step ran, named, with the slowest steps."""

from types import SimpleNamespace

from skyline.engine.step_trace import StepTrace


def _out(scheduled: dict[str, int], computed: dict[str, int]) -> SimpleNamespace:
    reqs = [SimpleNamespace(request_id=r, num_computed_tokens=n) for r, n in computed.items()]
    return SimpleNamespace(new_requests=[], cached_requests=reqs, num_scheduled_tokens=scheduled)


def test_steps_their_waits_and_compilations():
    clocks = [{"wait_s": 0.0, "compiles": 2, "compile_s": 1.0, "kernels": {"warm": 2}}]

    def clock() -> dict:
        return clocks[-1]

    trace = StepTrace(clock)
    trace(_out({"a": 1}, {"a": 5}), 0.0, 0.5)  # before reset: not recorded
    trace.reset()
    clocks.append({"wait_s": 0.001, "compiles": 4, "compile_s": 3.5,
                   "kernels": {"warm": 2, "prefill_attn": 1, "rope": 1}})
    trace(_out({"a": 100, "b": 1}, {"a": 0, "b": 9}), 0.0, 2.6)  # a prompt compiles 2 kernels
    clocks.append(clocks[-1] | {"wait_s": 0.009})
    trace(_out({"a": 1, "b": 1}, {"a": 100, "b": 10}), 0.0, 0.010)
    trace.stop()
    trace(_out({"a": 1}, {"a": 101}), 0.0, 9.0)  # after stop: not recorded
    s = trace.summary()
    assert (s["steps"], s["mixed_steps"], s["decode_steps"]) == (2, 1, 1)
    assert (s["mixed_prefill_tokens"], s["mixed_decode_tokens"], s["decode_tokens"]) == (100, 1, 2)
    assert s["compiles"] == 2 and abs(s["compile_seconds"] - 2.5) < 1e-9
    assert s["compiled_kernels"] == {"prefill_attn": 1, "rope": 1}
    slow = s["slowest_steps"]
    assert [r["compiles"] for r in slow] == [2, 0] and slow[0]["prefill"] == 100
    assert abs(slow[1]["wait_ms"] - 8.0) < 1e-9 and slow[1]["context"] == 101 + 11
    (batch,) = s["decode_by_batch"]
    assert batch["batch"] == "2-8" and abs(batch["wait_share"] - 0.8) < 1e-9
