"""Rounds of the tune loop: the worst family with a tuner is tuned, its winners written to this
user's kernel cache, the workload re-measured end to end, and the new table kept only if the
phases the family runs in got faster by more than `min_gain` (else the cache file is restored
as it was).

The loop is given its measurements and tuners as functions, so that it is the same on a GPU
and a CPU, and tests can inject the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyline.ops import tuning
from skyline.tune.rank import family_of
from skyline.tune.workload import Measurement

# A tuner: (the family's ranking row, seconds it may take) -> {kernel: {key: config}} to write.
Tuner = Callable[[dict[str, Any], float], dict[str, dict[str, dict[str, Any]]]]


@dataclass(frozen=True)
class LoopSpec:
    rounds: int
    budget_s: float  # tuning and re-measuring stop starting new work past this
    min_gain: float  # a round is kept if end to end improves by more than this fraction
    # --smoke: the first family with a tuner is tuned even when its measured time is within its
    # floor (on a busy CPU the floor, measured then, can pass the time), so every step runs
    any_loss: bool = False


class CacheFile:
    """This user's table of one device, with the bytes it held before a round (to restore)."""

    def __init__(self, path: Path, device: str) -> None:
        self.path, self.device = path, device

    def check(self) -> None:
        """Raise KernelConfigError (one sentence) now, before any measuring, if the file
        cannot be read or written."""
        if self.path.exists():
            data = tuning.read_configs(self.path)
            if data["device"] != self.device:
                raise tuning.KernelConfigError(
                    f"{self.path} holds configs for {data['device']!r}, not {self.device!r}; "
                    "delete it or set SKYLINE_KERNEL_CACHE to another folder")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            probe = self.path.parent / f".{self.path.name}.probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise tuning.KernelConfigError(
                f"cannot write kernel configs to {self.path.parent} ({e.strerror or e}); set "
                "SKYLINE_KERNEL_CACHE to a folder you can write") from None

    def snapshot(self) -> bytes | None:
        return self.path.read_bytes() if self.path.exists() else None

    def write(self, configs: dict[str, dict[str, dict[str, Any]]], meta: dict[str, Any]) -> None:
        tuning.write_configs(self.path, self.device, configs, meta=meta)

    def restore(self, saved: bytes | None) -> None:
        if saved is None:
            self.path.unlink(missing_ok=True)
        else:
            self.path.write_bytes(saved)
        tuning.reload()


def run_rounds(spec: LoopSpec, first: Measurement, ranked: list[dict[str, Any]],
               measure: Callable[[], tuple[Measurement, list[dict[str, Any]]]],
               tuners: dict[str, Tuner], cache: CacheFile, meta: dict[str, Any],
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Up to spec.rounds rounds, each on the family losing the most time whose tuner has not
    run yet; returns one record per round. `measure` runs the workload afresh (an
    engine that reads the cache as it is now) and ranks its profile."""
    t0 = time.monotonic()
    before, rank_before = first, ranked
    tried: set[str] = set()
    rounds: list[dict[str, Any]] = []
    for i in range(1, spec.rounds + 1):
        left = spec.budget_s - (time.monotonic() - t0)
        target = next((r for r in rank_before if r["tuner"] in tuners
                       and r["tuner"] not in tried and (r["lost_s"] > 0 or spec.any_loss)),
                      None)
        if target is None:
            log(f"round {i}: no family left with a tuner and time to gain")
            break
        if left <= 0:
            log(f"round {i}: the budget of {spec.budget_s:.0f} s is spent")
            break
        tried.add(target["tuner"])  # one tuner may serve two families (the CPU plan's)
        log(f"round {i}: tuning {target['family']} ({target['share']:.0%} of the profiled "
            f"time, {_frac(target['floor_fraction'])} of its floor), {left:.0f} s left")
        saved = cache.snapshot()
        # half of what is left: the re-measure and later rounds need the rest
        configs = tuners[target["tuner"]](target, left / 2)
        if not configs:
            log(f"round {i}: the {target['tuner']} tuner found nothing to change")
            rounds.append(_record(i, target, None, before, None, kept=False,
                                  note="nothing to change"))
            continue
        cache.write(configs, {**meta, "round": i, "family": target["family"]})
        after, rank_after = measure()
        # judged on the phases whose profile the family's kernels are in: a table cannot change
        # the others, whose run-to-run noise would only blur the verdict
        phases = phases_of(before, target["family"])
        t_before = sum(before.phase_s[p] for p in phases)
        t_after = sum(after.phase_s[p] for p in phases)
        kept = t_after < t_before * (1 - spec.min_gain)
        if not kept:
            cache.restore(saved)
        row_after = next((r for r in rank_after if r["family"] == target["family"]), None)
        rounds.append({**_record(i, target, row_after, before, after, kept, configs=configs),
                       "judged_on": phases, "judged_s_before": t_before,
                       "judged_s_after": t_after})
        log(table([rounds[-1]]))
        if kept:
            before, rank_before = after, rank_after
    return rounds


def phases_of(m: Measurement, family: str) -> list[str]:
    """The phases of `m` whose profile holds a kernel of `family` (every phase when none
    does, or nothing was profiled)."""
    ran = [p for p, ks in m.kernels.items() if any(family_of(k["name"]) == family for k in ks)]
    return [p for p in m.phase_s if p in ran] or list(m.phase_s)


def _record(i: int, target: dict[str, Any], after_row: dict[str, Any] | None,
            before: Measurement, after: Measurement | None, kept: bool,
            configs: dict[str, Any] | None = None, note: str | None = None) -> dict[str, Any]:
    return {
        "round": i, "family": target["family"], "tuner": target["tuner"],
        "share": target["share"], "floor_fraction_before": target["floor_fraction"],
        "floor_fraction_after": after_row["floor_fraction"] if after_row else None,
        "e2e_s_before": before.total_s, "e2e_s_after": after.total_s if after else None,
        "phase_s_before": before.phase_s, "phase_s_after": after.phase_s if after else None,
        "kept": kept, "configs": configs, "note": note,
    }


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rounds: list[dict[str, Any]]) -> str:
    """One line per round: family, time share, floor fraction and end-to-end seconds before
    and after, the phases the verdict was on (their seconds before and after), kept or
    reverted."""
    head = (f"{'round':>5}  {'family':<12} {'share':>6}  {'floor before':>12} "
            f"{'after':>6}  {'e2e before':>10} {'after':>9}  {'judged on':<36} result")
    lines = [head]
    for r in rounds:
        after = "-" if r["e2e_s_after"] is None else f"{r['e2e_s_after']:.4g}s"
        judged = "-"
        if r.get("judged_on"):
            judged = (f"{'+'.join(r['judged_on'])} {r['judged_s_before'] * 1e3:.4g}->"
                      f"{r['judged_s_after'] * 1e3:.4g}ms")
        lines.append(
            f"{r['round']:>5}  {r['family']:<12} {r['share']:>6.1%}  "
            f"{_frac(r['floor_fraction_before']):>12} {_frac(r['floor_fraction_after']):>6}  "
            f"{r['e2e_s_before']:>9.4g}s {after:>9}  {judged:<36} "
            f"{'kept' if r['kept'] else (r['note'] or 'reverted')}")
    return "\n".join(lines)


def ranking_table(ranked: list[dict[str, Any]]) -> str:
    """The families of one profile, most time lost first."""
    lines = [f"{'family':<12} {'share':>6} {'time':>9} {'floor':>9} {'fraction':>8}  tuner"]
    for r in ranked:
        lines.append(f"{r['family']:<12} {r['share']:>6.1%} {r['s'] * 1e3:>7.2f}ms "
                     f"{r['floor_s'] * 1e3:>7.2f}ms {_frac(r['floor_fraction']):>8}  "
                     f"{r['tuner'] or '(reported only)'}")
    return "\n".join(lines)
