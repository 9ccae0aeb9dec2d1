"""Rounds of `skyline tune` with injected measurements: a round that makes the workload faster
keeps its table in the user's cache, one that does not restores the file as it was; the budget
and the families without tuners stop the loop."""

from __future__ import annotations

import json

import pytest

from skyline import envs
from skyline.ops import tuning
from skyline.tune.loop import CacheFile, LoopSpec, run_rounds, table
from skyline.tune.workload import Measurement

DEVICE = "Test GPU"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYLINE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    tuning.reload()
    yield CacheFile(tuning.user_config_path(DEVICE), DEVICE)
    tuning.reload()


def m(total: float, prefill: float = 0.0, kernels: dict | None = None) -> Measurement:
    return Measurement({"prefill": prefill, "decode_1": total}, kernels or {})


def row(family: str, tuner: str | None, lost: float) -> dict:
    return {"family": family, "tuner": tuner, "share": 0.5, "floor_fraction": 0.5,
            "lost_s": lost}


def test_a_round_that_wins_is_kept_and_one_that_loses_is_reverted(cache):
    cache.write({"gemv": {"old": {"BLOCK_N": 8}}}, {"command": "before"})
    original = cache.path.read_bytes()
    ranked = [row("gemv", "gemv", 2.0), row("norm", None, 1.5), row("attention", "attn", 1.0)]
    after = iter([(m(9.0), [row("gemv", "gemv", 1.0), row("attention", "attn", 1.0)]),
                  (m(9.5), [])])
    seen = []

    def tuner(name):
        def tune(target, left):
            # the engine re-measured after a kept round reads the table of that round
            seen.append((name, tuning.get_config("gemv", "new", {}, device=DEVICE)))
            return {name: {"new": {"X": len(seen)}}}
        return tune

    rounds = run_rounds(LoopSpec(rounds=3, budget_s=60, min_gain=0.01), m(10.0), ranked,
                        lambda: next(after), {"gemv": tuner("gemv"), "attn": tuner("attn")},
                        cache, {"command": "test"}, log=lambda s: None)
    assert [(r["family"], r["kept"]) for r in rounds] == [("gemv", True), ("attention", False)]
    assert rounds[0]["e2e_s_before"] == 10.0 and rounds[0]["e2e_s_after"] == 9.0
    assert rounds[1]["e2e_s_before"] == 9.0 and rounds[1]["e2e_s_after"] == 9.5
    assert seen == [("gemv", {}), ("attn", {"X": 1})]
    data = json.loads(cache.path.read_text())
    # round 1's table stays, round 2's is gone (the file is as round 1 left it)
    assert data["configs"] == {"gemv": {"new": {"X": 1}, "old": {"BLOCK_N": 8}}}
    assert data["meta"]["round"] == 1 and data["history"] == [{"command": "before"}]
    assert tuning.get_config("attn", "new", {}, device=DEVICE) == {}
    assert cache.path.read_bytes() != original
    text = table(rounds)
    assert "kept" in text and "reverted" in text and "gemv" in text


def test_a_loss_restores_a_missing_file_as_missing(cache):
    rounds = run_rounds(LoopSpec(rounds=1, budget_s=60, min_gain=0.0), m(1.0),
                        [row("gemv", "gemv", 1.0)], lambda: (m(1.0), []),
                        {"gemv": lambda t, left: {"gemv": {"k": {"X": 1}}}}, cache, {},
                        log=lambda s: None)
    assert rounds[0]["kept"] is False  # equal is not faster
    assert not cache.path.exists()


def test_gain_must_beat_min_gain(cache):
    rounds = run_rounds(LoopSpec(rounds=1, budget_s=60, min_gain=0.05), m(1.0),
                        [row("gemv", "gemv", 1.0)], lambda: (m(0.97), []),
                        {"gemv": lambda t, left: {"gemv": {"k": {"X": 1}}}}, cache, {},
                        log=lambda s: None)
    assert rounds[0]["kept"] is False


def test_nothing_to_tune_or_no_budget_stops(cache):
    untuned = [row("norm", None, 1.0), row("gemv", "gemv", 0.0)]
    assert run_rounds(LoopSpec(3, 60, 0.0), m(1.0), untuned, None, {"gemv": None}, cache, {},
                      log=lambda s: None) == []
    assert run_rounds(LoopSpec(3, 0, 0.0), m(1.0), [row("gemv", "gemv", 1.0)], None,
                      {"gemv": None}, cache, {}, log=lambda s: None) == []
    # a tuner that finds nothing: no write, no re-measure
    rounds = run_rounds(LoopSpec(1, 60, 0.0), m(1.0), [row("gemv", "gemv", 1.0)], None,
                        {"gemv": lambda t, left: {}}, cache, {}, log=lambda s: None)
    assert rounds[0]["note"] == "nothing to change" and not cache.path.exists()


def test_judged_on_the_phases_the_family_runs_in(cache):
    # the GEMV runs in batch-1 decode only: a prefill that got faster by noise does not keep
    # its table, and a decode that got faster keeps it whatever the prefill did
    profile = {"prefill": [{"name": "nvjet_gemm", "s": 1.0}],
               "decode_1": [{"name": "_gemv_kernel", "s": 1.0}]}
    before = m(1.0, prefill=5.0, kernels=profile)
    gemv = {"gemv": lambda t, left: {"gemv": {"k": {"X": 1}}}}
    [r] = run_rounds(LoopSpec(1, 60, 0.01), before, [row("gemv", "gemv", 1.0)],
                     lambda: (m(1.0, prefill=4.0), []), gemv, cache, {}, log=lambda s: None)
    assert r["kept"] is False and r["judged_on"] == ["decode_1"]
    assert r["e2e_s_after"] < r["e2e_s_before"]
    [r] = run_rounds(LoopSpec(1, 60, 0.01), before, [row("gemv", "gemv", 1.0)],
                     lambda: (m(0.9, prefill=5.2), []), gemv, cache, {}, log=lambda s: None)
    assert r["kept"] is True and r["judged_s_after"] == 0.9
    assert "decode_1 1000->900ms" in table([r])
