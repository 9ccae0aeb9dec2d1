"""Offline throughput: N random-token prompts of a fixed length, fixed output length, one run."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import time
from typing import Any

from skyline.engine.args import EngineArgs
from skyline.engine.frontend.llm import LLM
from skyline.engine.step_trace import StepTrace
from skyline.types import SamplingParams


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Avoid the first ids, which are usually special tokens.
    lo = min(1000, vocab // 4)
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(num)]


def measure(llm: LLM, prompts: list[list[int]], output_len: int,
            trace: StepTrace | None = None, sampling: dict[str, float] | None = None
            ) -> dict[str, Any]:
    """Times one `generate` of all prompts after a short warm-up; `trace`, if given, sees
    every step of the timed run. `sampling`: SamplingParams fields (default greedy)."""
    params = SamplingParams(**{"temperature": 0.0, **(sampling or {})},
                            max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], dataclasses.replace(params, max_tokens=4))  # warm-up
    if trace is not None:
        trace.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    if trace is not None:
        trace.stop()
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": dt,
        "requests_per_s": len(prompts) / dt,
        "output_tokens_per_s": n_out / dt,
        "total_tokens_per_s": (n_in + n_out) / dt,
        "num_output_tokens": n_out,
        "num_prompt_tokens": n_in,
    }


CPUINFO = "/proc/cpuinfo"
# the CPU features the CPU plan and kernels choose by (ops/cpu_plan.py): two VMs that both
# report "Intel(R) Xeon(R) Processor" and AVX512 may differ in them
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
          "amx_int8", "avx_vnni")


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"host": platform.node(), "cpu_count": os.cpu_count(),
                            "cpu": _cpu_model(), "cpu_isa": torch.backends.cpu.get_cpu_capability(),
                            "cpu_flags": _cpu_flags(),
                            "torch": torch.__version__, "python": platform.python_version()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), so that a CPU figure names its CPU."""
    try:
        with open(CPUINFO, encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """Which of _FLAGS /proc/cpuinfo lists (empty off Linux)."""
    try:
        with open(CPUINFO, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in _FLAGS if flag in have]
    except OSError:
        pass
    return []


def median_call_s(fn: Any, min_s: float = 0.3) -> float:
    """Median seconds per call of `fn` (host-timed: CPU work) over at least `min_s` of calls
    and at least five, after three warm-up calls."""
    for _ in range(3):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def save_json(result: dict[str, Any], path: str | None) -> None:
    """Write a benchmark result (if a path is given), creating its folder."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def run_offline(args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                output: str | None, floor: bool = False,
                sampling: dict[str, float] | None = None) -> dict[str, Any]:
    """`floor`: measure the device's matmul peak and copy bandwidth first (before the engine
    takes its memory) and report the run against the floor they set (bench/floor.py).
    `sampling`: SamplingParams fields of every request (default greedy)."""
    peaks = _measure_peaks(args) if floor else None
    trace = StepTrace()
    llm = LLM(**dataclasses.asdict(args), observers=[trace])
    try:
        return _run(llm, trace, peaks, num_prompts, input_len, output_len, output, sampling)
    finally:
        llm.shutdown()  # its processes and memory, before a next engine in this process


def _run(llm: LLM, trace: StepTrace, peaks: Any, num_prompts: int, input_len: int,
         output_len: int, output: str | None, sampling: dict[str, float] | None
         ) -> dict[str, Any]:
    trace.clock = lambda: llm.query("step_clocks")
    cfg = llm.config
    prompts = random_prompts(num_prompts, input_len, cfg.model.arch.vocab_size, cfg.model.seed)
    res = measure(llm, prompts, output_len, trace, sampling)
    result = {
        "benchmark": "offline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": cfg.model.name,
        "load_format": cfg.model.load_format,
        "dtype": cfg.model.dtype,
        "sampling": sampling or {"temperature": 0.0},
        "device": cfg.device,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "quantization": cfg.model.quant.method,
        "kv_cache_dtype": cfg.cache.kv_cache_dtype,
        "machine": machine_info(cfg.device),
        "skyline": res,
        "engine": llm.engine.stats() | llm.query("describe"),
        "steps": trace.summary(),
    }
    print(f"{num_prompts} prompts x ({input_len} in, {output_len} out) on {cfg.device}: "
          f"{res['requests_per_s']:.2f} req/s, {res['output_tokens_per_s']:.1f} output tok/s, "
          f"{res['total_tokens_per_s']:.1f} total tok/s")
    if peaks is not None:
        result["floor"] = _floor(llm, peaks, num_prompts, input_len, output_len, res)
    eng = result["engine"]
    if "kv_offload_ram_hit_tokens" in eng:
        q = max(eng["prefix_cache_query_tokens"], 1)
        print(f"prefix hits: device {eng['prefix_cache_hit_tokens'] / q:.3f}, RAM "
              f"{eng['kv_offload_ram_hit_tokens'] / q:.3f}, disk "
              f"{eng.get('kv_offload_disk_hit_tokens', 0) / q:.3f} of "
              f"{eng['prefix_cache_query_tokens']} prompt tokens")
    st = result["steps"]
    print(f"steps: {st['mixed_steps']} with prefill {st['mixed_seconds']:.1f} s, "
          f"{st['decode_steps']} decode-only {st['decode_seconds']:.1f} s; "
          f"{st['compiles']} Triton compilations in the run ({st['compile_seconds']:.1f} s)")
    if st["compiled_kernels"]:
        print(f"  compiled: {st['compiled_kernels']}")
    for r in st["slowest_steps"][:3]:
        print(f"  slowest: {r['ms']:.1f} ms ({r['decode']} decodes, {r['prefill']} prefill "
              f"tokens, {r['compiles']} compilations)")
    for b in st["decode_by_batch"]:
        print(f"  decode {b['batch']:>9} seqs: {b['steps']:5d} steps, {b['mean_step_ms']:7.2f} "
              f"ms/step, context {b['mean_context']:6.0f}, host waits {b['wait_share']:.2f}")
    save_json(result, output)
    return result


def _measure_peaks(args: EngineArgs) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) of the device the engine will run on, for the products
    it runs at large batches: fp8 with fp8 weights, else bf16 (float32 on the CPU)."""
    import torch

    from skyline.bench.floor import copy_bandwidth, matmul_peak
    from skyline.engine.create import resolve_device

    device = torch.device(resolve_device(args.device))
    peak = matmul_peak(device, fp8=args.quantization == "fp8")
    bandwidth = copy_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak, bandwidth


def _floor(llm: LLM, peaks: tuple[float, float], num_prompts: int, input_len: int,
           output_len: int, res: dict[str, Any]) -> dict[str, Any]:
    from skyline.bench.floor import offline_floor

    cfg = llm.config
    capacity = llm.num_blocks * cfg.cache.block_size // (input_len + output_len)
    concurrency = min(cfg.scheduler.max_num_seqs, capacity)
    floor = offline_floor(llm.query("model_cost"), num_prompts, input_len, output_len,
                          concurrency, *peaks)
    floor["fraction_of_sequential"] = floor["sequential_s"] / res["elapsed_s"]
    floor["fraction_of_overlapped"] = floor["overlapped_s"] / res["elapsed_s"]
    print(f"floor at {floor['peak_TFLOPs']:.3g} TFLOP/s and {floor['bandwidth_TBps']:.3g} TB/s "
          f"(measured now), {floor['concurrency']} at a time: sequential "
          f"{floor['sequential_s']:.3g} s "
          f"({floor['sequential_tok_s']:.0f} tok/s: prefill {floor['prefill_s']:.3g}, decode "
          f"products {floor['decode_linear_s']:.3g}, decode attention "
          f"{floor['decode_attention_s']:.3g}), overlapped {floor['overlapped_s']:.3g} s; "
          f"this run {floor['fraction_of_sequential']:.2f} of the sequential floor")
    return floor
