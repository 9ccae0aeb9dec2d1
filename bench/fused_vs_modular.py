"""Fused against modular: what each fusion of the CUDA path buys in the time of a step (issue 31).

  python bench/fused_vs_modular.py --model llama-3.1-8b          # H200, dummy weights, ~3 min
  python bench/fused_vs_modular.py --quantization fp8            # also act_quant (W8A8 GEMVs)
  python bench/fused_vs_modular.py --smoke   # a tiny random model on the CPU: the code only

One engine, with CUDA graphs as it serves, times every step shape fused, then once with each
fusion in its modular form (SKYLINE_UNFUSE's names, skyline/envs.py; the engine query "unfuse"
switches them and captures the graphs again), then fused once more: the two fused runs bound
the noise. Shapes: decode steps of BATCHES rows (1, 64, 256) at --context tokens each, and one
prefill of --prefill-len (8,192) tokens. Each shape is set against its floor: its bytes over
the copy bandwidth and its FLOPs over the matmul peak, both measured in this run
(skyline/bench/floor.py). Then the kernels alone (CUDA graphs of --kernel-reps calls) where a
fusion is one op (norm, rope_kv, qk_norm, silu, argmax), and the merged projections, which the
engine cannot split without loading its weights differently: QKV as one Linear against three,
gate/up as one against two.

ratio = modular ms / fused ms. Verdict per row at --threshold (2%): "keep" where the modular
form is slower by more than that, "drop" where it is faster by more, "tie" within. Per fusion
(`verdicts`): "keep" if any end-to-end step keeps it, otherwise "drop": a fusion stays only
where the step's time says so. Nothing is removed here; the figures decide.
JSON: --out (default $OUT/fused-vs-modular-<device>-<model>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from skyline import envs
from skyline.bench.floor import copy_bandwidth, matmul_peak
from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.config import ModelArch
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams

BATCHES = (1, 64, 256)
SMOKE_BATCHES = (1, 4)
# Fusions every model of the engine makes (the others only where the model has them)
COMMON = ("norm", "rope_kv", "silu", "argmax", "pdl")


def fusions_of(arch: ModelArch, quantization: str) -> list[str]:
    """The SKYLINE_UNFUSE names that change something in this model's steps."""
    out = list(COMMON)
    if arch.qk_norm:
        out.append("qk_norm")
    if arch.num_experts:
        out += ["moe_route", "moe_gemv"]
    if quantization not in ("none", ""):
        out.append("act_quant")
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- end to end ---------------------------------------------------------------------------


def decode_tokens(rows: int, context: int, steps: int, rounds: int, step_tokens: int) -> int:
    """Tokens each decode row may make: the timed steps and the warm-up, and the steps the
    first rows decode while the last ones are still in prefill (`step_tokens` a step), so that
    no row finishes before the timing does."""
    return 3 + steps * rounds + -(-rows * context // step_tokens) + 4


def decode_ms(llm: LLM, device: str, rows: int, context: int, steps: int, rounds: int,
              step_tokens: int) -> float:
    """Milliseconds of one decode step of `rows` requests at about `context` tokens each: the
    best of `rounds` runs of `steps` steps (the same prompts every time: after the first run
    their prefill comes from the prefix cache)."""
    vocab = llm.config.model.arch.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=decode_tokens(rows, context, steps, rounds, step_tokens))
    rids = [llm.add_request(p, params) for p in random_prompts(rows, context, vocab, seed=rows)]
    sched = llm.engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):
        llm.step()
    for _ in range(3):
        llm.step()
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step(final_only=True)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / steps)
    if len(sched.running) != rows:  # (a row finished or was preempted: smaller steps timed)
        print(f"warning: {len(sched.running)} of {rows} decode rows left after the timing")
    for rid in rids:
        llm.abort(rid)
    while llm.engine.has_unfinished():
        llm.step()
    return best * 1e3


def prefill_ms(llm: LLM, device: str, length: int, rounds: int, seed: int) -> float:
    """Milliseconds of one prompt of `length` tokens to its first token (prompts of their own:
    nothing from the prefix cache), the best of `rounds` after a warm-up."""
    vocab = llm.config.model.arch.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts(rounds + 1, length, vocab, seed=seed)
    llm.generate([prompts[0]], one)
    best = float("inf")
    for p in prompts[1:]:
        sync(device)
        t0 = time.perf_counter()
        llm.generate([p], one)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def step_floors(cost: Any, batches: list[int], context: int, prefill: int, bw: float,
                peak: float) -> dict[str, float]:
    """Milliseconds of each shape's floor: a decode step's products at the larger of their
    FLOPs over the peak and the weights over the bandwidth, plus its attention at the larger
    of the K/V over the bandwidth and its FLOPs over the peak; a prefill's FLOPs over the peak
    (or its weights over the bandwidth, whichever is larger)."""
    per_token = 2 * (cost.linear_params + cost.head_params)
    out = {}
    for b in batches:
        products = max(cost.step_weight_bytes(b) / bw, per_token * b / peak)
        attention = max(b * context * cost.kv_bytes_per_token / bw,
                        cost.attn_flops_per_pair * b * context / peak)
        out[f"decode{b}"] = (products + attention) * 1e3
    flops = (2 * cost.linear_params * prefill + 2 * cost.head_params
             + cost.attn_flops_per_pair * prefill * (prefill + 1) / 2)
    out[f"prefill{prefill}"] = max(flops / peak, cost.weight_bytes / bw) * 1e3
    return out


def measure_steps(llm: LLM, device: str, a: argparse.Namespace, seed: int) -> dict[str, float]:
    out = {f"decode{b}": decode_ms(llm, device, b, a.context, a.steps, a.rounds, a.prefill_len)
           for b in a.batches}
    out[f"prefill{a.prefill_len}"] = prefill_ms(llm, device, a.prefill_len, a.rounds, seed)
    return out


# -- kernels alone ------------------------------------------------------------------------


def kernel_ms(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Milliseconds of one call of `fn`: on a GPU a CUDA graph of `reps` calls (launches as
    the engine's graphs make them), the best of 5 replays; on the CPU eager calls."""
    fn()
    fn()
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    del graph
    return best


def unfused_as(names: frozenset[str]) -> None:
    """This process's ops from now on (the engine is gone by then)."""
    envs.ENV = dataclasses.replace(envs.ENV, unfuse=names)


Op = tuple[Callable[[], Any], Callable[[], Any] | None]  # (fused, modular; None: SKYLINE_UNFUSE)


def kernel_ops(arch: ModelArch, device: str, rows: int, wts: dict[str, torch.Tensor]
               ) -> dict[str, Op]:
    """The calls to time at `rows` rows: each one-op fusion (its modular form is the same call
    under SKYLINE_UNFUSE=<name>), and each merged projection against its parts."""
    from skyline.ops.activation import silu_and_mul
    from skyline.ops.argmax import argmax
    from skyline.ops.gemv import gemv_or_linear
    from skyline.ops.kv_write import KVWrite
    from skyline.ops.norm import fused_add_rms_norm
    from skyline.ops.rotary import qk_norm_rotary, rotary_embedding

    dt, rope = wts["wq"].dtype, wts["rope"]
    h, hd, nh, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    x, res = (torch.randn(rows, h, device=device, dtype=dt) for _ in range(2))
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, device=device, dtype=dt)
    q, k, v = (p.unflatten(-1, (-1, hd)) for p in qkv.split([nh * hd, nkv * hd, nkv * hd], -1))
    pos = torch.arange(rows, device=device) % rope.shape[0]
    page = 16
    cache = torch.zeros(2, -(-rows // page), page, nkv, hd, device=device, dtype=dt)
    kv = KVWrite(v, cache, torch.arange(rows, device=device))
    gate_up = torch.randn(rows, 2 * wts["wg"].shape[0], device=device, dtype=dt)
    nw, qn = wts["norm"], wts["qk_norm"]
    ops: dict[str, Op] = {
        "norm": (lambda: fused_add_rms_norm(x, res, nw, 1e-5), None),
        "rope_kv": (lambda: rotary_embedding(pos, q, k, rope, kv=kv), None),
        "silu": (lambda: silu_and_mul(gate_up), None),
        "qkv": (lambda: gemv_or_linear(x, wts["wqkv"]),
                lambda: [gemv_or_linear(x, wts[n]) for n in ("wq", "wk", "wv")]),
    }
    if not arch.num_experts:  # (an MoE's experts stack gate/up in their own kernels)
        ops["gate_up"] = (lambda: gemv_or_linear(x, wts["wgu"]),
                          lambda: [gemv_or_linear(x, wts[n]) for n in ("wg", "wu")])
    if arch.qk_norm:
        ops["qk_norm"] = (lambda: qk_norm_rotary(pos, q, k, rope, qn, qn, 1e-6, kv=kv), None)
    if rows <= 256:  # only the rows that sample take the argmax
        logits = torch.randn(rows, arch.vocab_size, device=device)
        ops["argmax"] = (lambda: argmax(logits), None)
    return ops


def kernel_rows(arch: ModelArch, device: str, rows_list: list[int], reps: int
                ) -> list[dict[str, Any]]:
    """kernel_ops fused against modular at every row count."""
    from skyline.model.layers.rotary import RotaryEmbedding

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    h, hd = arch.hidden_size, arch.head_dim
    inter = arch.moe_intermediate_size if arch.num_experts else arch.intermediate_size
    w = lambda *shape: torch.randn(*shape, device=device, dtype=dt) * 0.02  # noqa: E731
    wts = {"wq": w(arch.num_heads * hd, h), "wk": w(arch.num_kv_heads * hd, h),
           "wv": w(arch.num_kv_heads * hd, h), "wg": w(inter, h), "wu": w(inter, h),
           "norm": torch.rand(h, device=device, dtype=dt) + 0.5,
           "qk_norm": torch.rand(hd, device=device, dtype=dt) + 0.5}
    wts["wqkv"] = torch.cat((wts["wq"], wts["wk"], wts["wv"]))
    wts["wgu"] = torch.cat((wts["wg"], wts["wu"]))
    with torch.device(device):
        wts["rope"] = RotaryEmbedding(hd, min(arch.max_position_embeddings, 16384),
                                      arch.rope_theta, arch.rope_scaling).cos_sin_cache
    out = []
    for rows in rows_list:
        for name, (fused, modular) in kernel_ops(arch, device, rows, wts).items():
            unfused_as(frozenset())
            fused_ms = kernel_ms(fused, device, reps)
            if modular is None:  # the same call, the name unfused
                unfused_as(frozenset({name}))
                modular = fused
            modular_ms = kernel_ms(modular, device, reps)
            unfused_as(frozenset())
            out.append({"fusion": name, "shape": f"kernel{rows}", "fused_ms": fused_ms,
                        "unfused_ms": modular_ms})
    return out


# -- report -------------------------------------------------------------------------------


def verdict(ratio: float, threshold: float) -> str:
    if ratio > 1 + threshold:
        return "keep"
    return "drop" if ratio < 1 - threshold else "tie"


def finish(rows: list[dict[str, Any]], threshold: float) -> None:
    for r in rows:
        r["ratio"] = r["unfused_ms"] / r["fused_ms"]
        r["verdict"] = verdict(r["ratio"], threshold)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'fusion':<10} {'shape':<13} {'fused ms':>10} {'unfused ms':>11} {'ratio':>7} "
          f"{'floor ms':>9}  verdict")
    for r in rows:
        floor = f"{r['floor_ms']:9.3f}" if "floor_ms" in r else " " * 9
        print(f"{r['fusion']:<10} {r['shape']:<13} {r['fused_ms']:10.3f} {r['unfused_ms']:11.3f}"
              f" {r['ratio']:7.3f} {floor}  {r['verdict']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--fusions", nargs="*", default=None,
                    help="SKYLINE_UNFUSE names to measure (default: those the model makes)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of a decode row")
    ap.add_argument("--prefill-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20, help="decode steps a round times")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel-reps", type=int, default=50)
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--threshold", type=float, default=0.02)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, tiny shapes, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("fused_vs_modular", a.smoke)
    try:  # a name that is not a fusion: one sentence before any run
        envs.parse_unfuse(",".join(a.fusions or []))
    except ValueError as e:
        raise SystemExit(str(e).replace("SKYLINE_UNFUSE", "--fusions")) from None
    extra: dict[str, Any] = {}
    if a.smoke:
        a.model, a.batches, a.context, a.prefill_len = tiny_model(), list(SMOKE_BATCHES), 16, 64
        a.steps, a.rounds, a.kernel_reps = 3, 1, 2
        extra["kv_cache_memory"] = "64MiB"
    a.out = a.out or os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                                  f"fused-vs-modular-{device}-"
                                  f"{os.path.basename(a.model.rstrip('/'))}.json")
    # the device's rates first, before the engine takes its memory
    bw, peak = copy_bandwidth(torch.device(device)), matmul_peak(torch.device(device))
    if device == "cuda":
        torch.cuda.empty_cache()  # their buffers back before the engine sizes its KV cache
    t_start = time.perf_counter()
    llm = LLM(a.model, load_format=a.load_format, quantization=a.quantization, device=device,
              max_model_len=max(a.prefill_len, a.context + decode_tokens(
                  max(a.batches), a.context, a.steps, a.rounds, a.prefill_len)) + 64,
              max_num_seqs=max(a.batches), max_num_batched_tokens=a.prefill_len, **extra)
    arch = llm.config.model.arch
    names = a.fusions if a.fusions is not None else fusions_of(arch, a.quantization)
    floors = step_floors(llm.query("model_cost"), a.batches, a.context, a.prefill_len, bw, peak)
    fused = [measure_steps(llm, device, a, seed=100)]
    modular, capture_s = {}, {}
    for i, name in enumerate(names):
        capture_s[name] = llm.query("unfuse", [name], a.batches)
        modular[name] = measure_steps(llm, device, a, seed=200 + i * 10)
        print(f"{name}: " + ", ".join(f"{s} {ms:.3f} ms" for s, ms in modular[name].items()),
              flush=True)
    llm.query("unfuse", [], a.batches)
    fused.append(measure_steps(llm, device, a, seed=900))
    engine_s = time.perf_counter() - t_start
    llm.shutdown()
    del llm
    gc.collect()
    # fused: the better of the runs before and after; noise: how far apart they were
    best = {s: min(run[s] for run in fused) for s in floors}
    noise = {s: abs(fused[0][s] - fused[1][s]) / best[s] for s in floors}
    rows = [{"fusion": name, "shape": s, "fused_ms": best[s], "unfused_ms": ms,
             "floor_ms": floors[s]} for name in names for s, ms in modular[name].items()]
    kernels = [] if a.no_kernels else kernel_rows(arch, device, [*a.batches, a.prefill_len],
                                                 a.kernel_reps)
    finish(rows, a.threshold)
    finish(kernels, a.threshold)
    verdicts = {name: "keep" if any(r["verdict"] == "keep" for r in rows
                                    if r["fusion"] == name) else "drop" for name in names}
    print_table(rows + kernels)
    print("fused step ms (before, after; noise): " + ", ".join(
        f"{s} {fused[0][s]:.3f}/{fused[1][s]:.3f} ({noise[s]:.1%})" for s in floors))
    print("verdicts: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()))
    res = {
        "benchmark": "fused_vs_modular",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(["python", *sys.argv]), "model": a.model,
        "quantization": a.quantization, "context": a.context, "prefill_len": a.prefill_len,
        "steps": a.steps, "rounds": a.rounds, "threshold": a.threshold,
        "copy_bandwidth_TBps": bw / 1e12, "matmul_peak_TFLOPs": peak / 1e12,
        "fused_runs_ms": fused, "noise": noise, "floors_ms": floors,
        "graph_capture_s": capture_s, "engine_s": engine_s,
        "rows": rows, "kernels": kernels, "verdicts": verdicts,
        "machine": machine_info(device),
    }
    save_json(res, a.out)


if __name__ == "__main__":
    main()
