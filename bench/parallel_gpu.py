"""Tensor and pipeline parallelism on N GPUs of one host (H200s), as stages:

  decode   batch-1 decode at TP=N against the roofline of N GPUs' bandwidth: the bytes a token
           reads (every rank's weights and KV, summed: the "model_cost" query) over N times
           one GPU's copy bandwidth, measured in this run
  offline  N prompts x (IN in, OUT out) at TP=N against TP=1 (default 1000 x (1000, 1000))
  pp       the same workload at PP=N against TP=N (the same N GPUs)
  ep       a MoE model (--model qwen3-30b-a3b): the same workload at TP=N with
           --expert-parallel (whole experts per GPU, tokens moved by all-to-all; eager) against
           TP=N (every expert split N ways)
  mp1      one GPU: the same workload through the multi-process executor at world size 1
           against the engine's own process (the executor's cost), and their greedy tokens
  placement  one GPU and the host: PP=2 over --placement cuda=L-C,cpu=C (the last --cpu-layers
           layers, 1 by default, and the LM head on the CPU) against the whole model on the
           GPU: batch-1 decode against the floor of each layout (each part's weight bytes over
           its memory's rate: the GPU's copy bandwidth, the host's read bandwidth, measured in
           this run) and greedy tokens (a CPU stage runs the CPU kernels: in bf16 tokens may
           part)

    python bench/parallel_gpu.py --gpus 2 --stages decode offline pp
    python bench/parallel_gpu.py --gpus 1 --stages decode offline pp --num-prompts 64  # 1 GPU
    python bench/parallel_gpu.py --gpus 1 --stages mp1 placement --num-prompts 256
    python bench/parallel_gpu.py --gpus 2 --stages ep --model qwen3-30b-a3b

With --gpus 1 every stage runs (TP=1, PP=1), as a check of the script on one GPU. Each stage
writes bench/results/parallel/<stage>-h200-<model>-gpus<N>.json (--out-dir). --smoke runs the
one-GPU stages (mp1, placement) on the CPU with a tiny random model and a few requests, seconds
(a check that the script works, in CI).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

import torch

from skyline.bench.floor import copy_bandwidth, host_read_bandwidth
from skyline.bench.offline import machine_info, random_prompts, run_offline, save_json
from skyline.bench.smoke import tiny_model
from skyline.engine.args import EngineArgs
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams


def stamp(args: argparse.Namespace) -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "model": args.model, "gpus": args.gpus,
            "machine": machine_info("cpu" if args.smoke else "cuda"),
            "command": "python bench/parallel_gpu.py " + " ".join(sys.argv[1:])}


def stage_decode(args: argparse.Namespace) -> dict[str, Any]:
    bw = copy_bandwidth(torch.device("cuda:0"))  # before any engine takes memory
    torch.cuda.empty_cache()
    llm = LLM(args.model, **args.engine, tensor_parallel_size=args.gpus, max_num_seqs=8,
              max_model_len=args.prompt_len + args.new_tokens + 16)
    try:
        cost = llm.query("model_cost")
        prompt = random_prompts(1, args.prompt_len, llm.config.model.arch.vocab_size)[0]

        def run(n: int) -> float:
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                  ignore_eos=True))
            return time.perf_counter() - t

        run(8)  # warm-up
        first = min(run(1) for _ in range(3))  # the prefill and one token
        total = min(run(1 + args.new_tokens) for _ in range(3))
    finally:
        llm.shutdown()
    rate = args.new_tokens / (total - first)
    mean_ctx = args.prompt_len + args.new_tokens / 2
    bytes_per_token = cost.weight_bytes + cost.kv_bytes_per_token * mean_ctx
    roofline = args.gpus * bw / bytes_per_token
    print(f"decode TP={args.gpus}: {rate:.1f} tok/s, roofline of {args.gpus} GPU(s) "
          f"{roofline:.1f} tok/s ({rate / roofline:.2f}); one GPU copies at {bw / 1e12:.2f} TB/s, "
          f"a token reads {bytes_per_token / 2**30:.2f} GiB")
    return {"benchmark": "parallel_decode", **stamp(args), "tensor_parallel_size": args.gpus,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "tokens_per_s": rate, "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": rate / roofline, "copy_bandwidth_Bps_per_gpu": bw,
            "bytes_per_token": bytes_per_token, "weight_bytes": cost.weight_bytes}


def _offline(args: argparse.Namespace, **parallel: Any) -> dict[str, Any]:
    engine = EngineArgs(model=args.model, **args.engine, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.input_len + args.output_len + 16, **parallel)
    return run_offline(engine, args.num_prompts, args.input_len, args.output_len, None)


def _compare(args: argparse.Namespace, name: str, runs: list[tuple[str, dict[str, Any]]]
             ) -> dict[str, Any]:
    """The workload under two layouts: the first's output tokens per second over the
    second's."""
    rows = []
    for label, parallel in runs:
        res = _offline(args, **parallel)
        rows.append({"layout": label, **parallel, **res["skyline"], "steps": res["steps"],
                     "engine": res["engine"]})
    a, b = rows
    ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"]
    print(f"{name}: {a['layout']} {a['output_tokens_per_s']:.0f} output tok/s, {b['layout']} "
          f"{b['output_tokens_per_s']:.0f} ({ratio:.2f}x)")
    return {"benchmark": f"parallel_{name}", **stamp(args), "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len,
            "runs": rows, "ratio": ratio}


def stage_offline(args: argparse.Namespace) -> dict[str, Any]:
    n = args.gpus
    return _compare(args, "offline", [(f"TP={n}", {"tensor_parallel_size": n}),
                                      ("TP=1", {"tensor_parallel_size": 1})])


def stage_pp(args: argparse.Namespace) -> dict[str, Any]:
    n = args.gpus
    return _compare(args, "pp", [(f"PP={n}", {"pipeline_parallel_size": n}),
                                 (f"TP={n}", {"tensor_parallel_size": n})])


def stage_ep(args: argparse.Namespace) -> dict[str, Any]:
    n = args.gpus
    return _compare(args, "ep", [(f"EP={n}", {"tensor_parallel_size": n,
                                              "expert_parallel": True}),
                                 (f"TP={n}", {"tensor_parallel_size": n})])


def _greedy(llm: LLM, n: int, new_tokens: int) -> list[list[int]]:
    prompts = random_prompts(n, 64, llm.config.model.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _same_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of tokens before the first difference, over all sequences."""
    same = sum(next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), len(s))
               for s, t in zip(a, b, strict=True))
    return same / max(1, sum(len(s) for s in a))


def stage_mp1(args: argparse.Namespace) -> dict[str, Any]:
    res = _compare(args, "mp1", [("mp", {"distributed_executor": "mp"}),
                                 ("uni", {"distributed_executor": "uni"})])
    tokens = []
    for executor in ("mp", "uni"):
        llm = LLM(args.model, **args.engine, distributed_executor=executor,
                  max_model_len=256, max_num_seqs=16)
        try:
            tokens.append(_greedy(llm, 16, 64))
        finally:
            llm.shutdown()
    res["greedy_identical"] = tokens[0] == tokens[1]
    print(f"mp1: greedy tokens identical: {res['greedy_identical']}")
    return res


def stage_placement(args: argparse.Namespace) -> dict[str, Any]:
    # the floor of each part: its weight bytes over its own memory's rate, both measured here
    gpu = torch.device("cpu" if args.smoke else "cuda:0")
    gpu_bw, host_bw = copy_bandwidth(gpu), host_read_bandwidth()
    if gpu.type == "cuda":
        torch.cuda.empty_cache()
    rows, tokens, kw, cost = [], [], {}, None
    for label in ("gpu", "gpu+cpu"):
        llm = LLM(args.model, **args.engine, max_model_len=256, max_num_seqs=4, **kw)
        try:
            tokens.append(_greedy(llm, 4, 32))
            arch = llm.config.model.arch
            cost = cost or llm.query("model_cost")  # the whole model's, from one process
            itemsize = getattr(torch, llm.config.model.dtype).itemsize
            prompt = random_prompts(1, 64, arch.vocab_size)[0]
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            llm.generate([prompt], params)  # warm-up
            t = time.perf_counter()
            llm.generate([prompt], params)
            rate = params.max_tokens / (time.perf_counter() - t)
            kernels = llm.query("describe")["cpu_kernels"]  # the CPU stage's
        finally:
            llm.shutdown()
        # The last stage holds the LM head: on the CPU in the split layout.
        head_bytes = cost.head_params * itemsize
        layer_bytes = (cost.weight_bytes - head_bytes) / arch.num_layers
        cpu_layers = args.cpu_layers if kw else 0
        gpu_bytes = (arch.num_layers - cpu_layers) * layer_bytes + (0 if kw else head_bytes)
        cpu_bytes = cpu_layers * layer_bytes + (head_bytes if kw else 0)
        floor = 1 / (gpu_bytes / gpu_bw + cpu_bytes / host_bw)
        rows.append({"layout": label, **kw, "decode_tokens_per_s": rate,
                     "gpu_weight_bytes": gpu_bytes, "cpu_weight_bytes": cpu_bytes,
                     "floor_tokens_per_s": floor, "fraction_of_floor": rate / floor,
                     "cpu_kernels": kernels})
        print(f"placement {label} {kw}: batch-1 decode {rate:.1f} tok/s, floor {floor:.1f} "
              f"({rate / floor:.2f}): {gpu_bytes / 2**30:.2f} GiB at {gpu_bw / 1e9:.0f} GB/s + "
              f"{cpu_bytes / 2**30:.2f} GiB at {host_bw / 1e9:.0f} GB/s")
        for k in kernels:
            print(f"  a CPU rank's kernels: {k}")
        first = "cpu" if args.smoke else "cuda:0"  # --smoke: two CPU stages
        kw = {"placement": f"{first}={arch.num_layers - args.cpu_layers},cpu={args.cpu_layers}"}
    same = _same_prefix(tokens[0], tokens[1])
    print(f"placement: greedy tokens equal before the first difference: {same:.2f}")
    return {"benchmark": "parallel_placement", **stamp(args), "cpu_layers": args.cpu_layers,
            "device_bandwidth_Bps": gpu_bw, "host_read_bandwidth_Bps": host_bw,
            "runs": rows, "greedy_same_prefix_fraction": same}


STAGES = {"decode": stage_decode, "offline": stage_offline, "pp": stage_pp, "ep": stage_ep,
          "mp1": stage_mp1, "placement": stage_placement}


def gpu_label() -> str:
    """"h200", "h100" (the results' file names), else "gpu"."""
    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
    return next((g for g in ("h200", "h100") if g in name), "gpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", choices=list(STAGES),
                    default=["decode", "offline", "pp"])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompt-len", type=int, default=512, help="decode: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="decode: tokens timed")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--cpu-layers", type=int, default=1,
                    help="placement: the layers of the model's CPU stage")
    ap.add_argument("--out-dir", default="bench/results/parallel")
    ap.add_argument("--smoke", action="store_true",
                    help="mp1 and placement on the CPU, a tiny model, a few requests")
    args = ap.parse_args()
    args.engine = {"load_format": "dummy"}
    where = gpu_label()
    if args.smoke:
        args.engine = {"device": "cpu", "load_format": "dummy"}
        args.model, args.gpus, where = tiny_model(), 1, "smoke"
        args.stages = ["mp1", "placement"]
        args.num_prompts, args.input_len, args.output_len, args.max_num_seqs = 4, 16, 4, 4
    elif not torch.cuda.is_available() or args.gpus < 1:
        sys.exit("parallel_gpu.py needs CUDA GPUs")
    for name in args.stages:
        result = STAGES[name](args)
        model = "tiny" if args.smoke else os.path.basename(args.model.rstrip("/"))
        save_json(result, os.path.join(args.out_dir,
                                       f"{name}-{where}-{model}-gpus{args.gpus}.json"))


if __name__ == "__main__":
    main()
