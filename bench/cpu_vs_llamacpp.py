"""skyline against llama.cpp on the CPU, on the same GGUF files with the same threads, in one run.

    python bench/cpu_vs_llamacpp.py --llama-bin DIR [--threads 2] [--rounds 3] [--models
        q4_1,q4_k_m,q8_0] [--parts offline,serve] [--out bench/results/cpu/….json]
    python bench/cpu_vs_llamacpp.py --smoke      # skyline only, tiny settings, no llama.cpp

DIR holds llama.cpp's llama-bench, llama-server and llama-quantize. The models: the embedded
default (SmolLM2-135M-Instruct Q4_1) and files llama-quantize makes from it (Q4_K_M, Q8_0; `bf16`:
the Q4_1 weights in 16 bits, dense bfloat16 products; kept in --work-dir); `moe_q4_k_m`, a
mixture-of-experts model of random weights in Qwen3-30B-A3B's layer shape (6 of its 48 layers:
128 experts of 768, top 8; skyline/bench/random_gguf.py), which llama-quantize makes Q4_K_M from
F16 (the smoke run writes a tiny one, `moe_tiny`, with gguf-py's Q4_1); or any GGUF file, by its
path (a name ending in .gguf). skyline runs each with no flags but the threads (the CPU plan of
ops/cpu_plan.py chooses dtype and kernels). Per model:

- batch-1 decode and prefill against `llama-bench` (tg N: N tokens generated one at a time
  from an empty context; pp P: one P-token prompt): skyline in this process (prefix caching
  off) generates N tokens after a one-token prompt (decode = the time past the first token),
  and prefills a P-token prompt (the time of a one-token generation); one llama-bench
  repetition and one skyline measurement alternate for --rounds rounds.
- 16 streams through `skyline serve` against `llama-server` (16 slots, continuous batching):
  random prompts of 64 tokens, 128 output tokens, EOS ignored, both servers up for the whole
  cell and the engines alternating by round (bench/llamacpp_serve.py's protocol): aggregate
  output tok/s and TTFT p50.

The floor of batch-1 decode is the bytes one step reads (the weights each engine holds for a
one-row product, skyline's KV read included; of a mixture of experts, the top-k share of the
experts, each engine's as it stores them) over the read bandwidth measured in the same run (a sum
over 256 MiB at the run's threads). Each model's entry also has the weights skyline holds and
this process's resident memory once it is loaded, against the file's size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from skyline import LLM, SamplingParams
from skyline.bench.floor import host_read_bandwidth
from skyline.bench.frontier import start_server, stop_server
from skyline.bench.metrics import summarize
from skyline.bench.offline import machine_info, save_json
from skyline.bench.serve import LoadSpec, run_load
from skyline.bench.workloads import WorkloadSpec
from skyline.engine.create import resolve_model_path
from skyline.engine.step_trace import timed
from skyline.ops import cpu_plan

QUANT_TYPES = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0", "bf16": "BF16"}  # made from the default


def llamacpp_serve() -> Any:
    """bench/llamacpp_serve.py (the serving protocol), imported only with llama.cpp at hand."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llamacpp_serve

    return llamacpp_serve


def model_file(name: str, work_dir: str, llama_bin: str | None) -> str:
    if name.endswith(".gguf"):  # a file of the user's
        if not os.path.exists(name):
            raise SystemExit(f"{name} does not exist")
        return name
    default = resolve_model_path(None, "auto")
    if name == "q4_1":
        return default
    if name.startswith("moe_") or name not in QUANT_TYPES:
        return moe_file(name, work_dir, llama_bin, default)  # an unknown name's message too
    path = os.path.join(work_dir, f"smollm2-135m-{QUANT_TYPES[name]}.gguf")
    if not os.path.exists(path):
        if llama_bin is None:
            raise SystemExit(f"{path} does not exist; give --llama-bin to make it")
        os.makedirs(work_dir, exist_ok=True)
        subprocess.run([os.path.join(llama_bin, "llama-quantize"), "--allow-requantize",
                        default, path, QUANT_TYPES[name]], check=True, capture_output=True)
    return path


def moe_file(name: str, work_dir: str, llama_bin: str | None, tokenizer_from: str) -> str:
    """The mixture-of-experts file `name` (module docstring), made where it is missing."""
    from gguf import GGMLQuantizationType

    from skyline.bench.random_gguf import QWEN3_30B_A3B_LAYERS, TINY, write_moe_gguf

    if name == "moe_tiny":
        path = os.path.join(work_dir, "qwen3moe-tiny-Q4_1.gguf")
        if not os.path.exists(path):
            write_moe_gguf(path, TINY, tokenizer_from, GGMLQuantizationType.Q4_1)
        return path
    if name != "moe_q4_k_m":
        raise SystemExit(f"unknown model {name!r} (see --help)")
    path = os.path.join(work_dir, "qwen3moe-a3b-6layers-Q4_K_M.gguf")
    if not os.path.exists(path):
        if llama_bin is None:
            raise SystemExit(f"{path} does not exist; give --llama-bin to make it")
        f16 = path.replace("Q4_K_M", "F16")
        write_moe_gguf(f16, QWEN3_30B_A3B_LAYERS, tokenizer_from)
        subprocess.run([os.path.join(llama_bin, "llama-quantize"), f16, path, "Q4_K_M"],
                       check=True, capture_output=True)
        os.remove(f16)
    return path


def gguf_step_bytes(path: str) -> int:
    """Bytes of `path` a batch-1 decode step reads: every tensor but the token embedding
    (one row of it; unless it is also the LM head), of the experts the top-k share."""
    from gguf import GGUFReader

    r = GGUFReader(path)

    def value(key: str) -> Any:
        field = r.fields.get(key)
        return 1 if field is None else field.contents()

    arch = value("general.architecture")
    share = value(f"{arch}.expert_used_count") / value(f"{arch}.expert_count")
    names = {t.name for t in r.tensors}
    total = 0.0
    for t in r.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(t.n_bytes) * (share if "_exps." in t.name else 1)
    return round(total)


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0


def step_bytes(llm: LLM, context: int) -> float:
    """Bytes a batch-1 decode step reads (skyline/model/cost.py, as the layers serve: the int4
    kernel's planes where a Linear has them, the LM head as it computes) and the K/V of
    `context` tokens."""
    cost = llm.query("model_cost")
    return cost.step_weight_bytes(1) + context * cost.kv_bytes_per_token


def skyline_decode_prefill(llm: LLM, prompt_len: int, gen_len: int) -> tuple[float, float]:
    """(decode tok/s at batch 1 after a one-token prompt, prefill tok/s of one prompt)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    one = [[100]]
    t = time.perf_counter()
    llm.generate(one, params)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(one, SamplingParams(temperature=0.0, max_tokens=gen_len + 1, ignore_eos=True))
    decode = gen_len / max(time.perf_counter() - t - first, 1e-9)
    prompt = [[(7 * j) % 1000 + 100 for j in range(prompt_len)]]
    t = time.perf_counter()
    llm.generate(prompt, params)
    return decode, prompt_len / (time.perf_counter() - t)


def decode_breakdown(llm: LLM, gen_len: int) -> dict[str, Any]:
    """Where a batch-1 decode step's time goes (ms per step): the layers' weight products (the
    int4 kernel's calls from Python; 0 where the C++ decode step runs the layers, whose
    products are then in "layers_other"), the rest of the layers, the LM head, sampling, the
    runner's input building and token reading, the scheduler, and what is left (the engine's
    and the front end's outputs, detokenizing), from the engine's cpu_step_seconds probe and the
    scheduler's calls timed here."""
    sched = llm.engine.scheduler
    phases = {"schedule": 0.0, "update": 0.0}
    schedule, update = sched.schedule, sched.update
    sched.schedule, sched.update = (timed(phases, "schedule", schedule),
                                    timed(phases, "update", update))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        marks = []
        for n in (1, gen_len + 1):  # decode: the second generation less the first
            s0, p0 = llm.query("cpu_step_seconds"), dict(phases)
            t = time.perf_counter()
            llm.generate([[100]], params if n == 1 else
                         SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            wall = time.perf_counter() - t
            s1 = llm.query("cpu_step_seconds")
            marks.append({"wall": wall} | {k: s1[k] - s0[k] for k in s1}
                         | {k: phases[k] - p0[k] for k in phases})
    finally:
        sched.schedule, sched.update = schedule, update
    d = {k: (marks[1][k] - marks[0][k]) * 1e3 / gen_len for k in marks[0]}
    split = {"linears": d["linears"], "layers_other": d["forward"] - d["linears"],
             "lm_head": d["lm_head"], "sample": d["sample"], "inputs": d["inputs"],
             "read_tokens": d["read_tokens"], "schedule": d["schedule"], "update": d["update"]}
    split["engine_other"] = d["wall"] - sum(split.values())
    return {"step_ms": d["wall"], "products_ms": d["linears"] + d["lm_head"],
            "other_ms": d["wall"] - d["linears"] - d["lm_head"],
            "products_share": (d["linears"] + d["lm_head"]) / d["wall"],
            "split_ms": {k: round(v, 3) for k, v in split.items()}}


def llama_bench(llama_bin: str, model: str, threads: int, prompt_len: int, gen_len: int
                ) -> tuple[float, float]:
    """(tg tok/s, pp tok/s) of one llama-bench repetition (after its own warm-up run)."""
    cmd = [os.path.join(llama_bin, "llama-bench"), "-m", model, "-t", str(threads),
           "-p", str(prompt_len), "-n", str(gen_len), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    return tg, pp


def ratio_summary(sky: list[float], ref: list[float]) -> dict[str, Any]:
    return {"skyline": sky, "llama.cpp": ref,
            "skyline_median": statistics.median(sky), "llamacpp_median": statistics.median(ref),
            "ratio_of_medians": statistics.median(sky) / statistics.median(ref),
            "ratio_per_round": [round(s / r, 3) for s, r in zip(sky, ref, strict=True)]}


def bench_offline(model: str, ns: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    llm = LLM(model=model, threads=ns.threads, enable_prefix_caching=False)
    skyline_decode_prefill(llm, min(ns.prompt_len, 64), 8)  # warm-up
    dec: dict[str, list[float]] = {"skyline": [], "llama.cpp": []}
    pre: dict[str, list[float]] = {"skyline": [], "llama.cpp": []}
    for r in range(ns.rounds):
        order = ("skyline", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "skyline")
        for engine in order:
            if engine == "skyline":
                d, p = skyline_decode_prefill(llm, ns.prompt_len, ns.gen_len)
            elif ns.llama_bin is None:
                continue
            else:
                d, p = llama_bench(ns.llama_bin, model, ns.threads, ns.prompt_len, ns.gen_len)
            dec[engine].append(d)
            pre[engine].append(p)
            print(f"  round {r} {engine:<9} decode b1 {d:7.1f} tok/s  prefill {p:7.1f} tok/s",
                  flush=True)
    cfg = llm.engine.config.model
    sky_bytes = step_bytes(llm, ns.gen_len // 2)
    breakdown = decode_breakdown(llm, ns.gen_len)
    print(f"  skyline batch-1 step {breakdown['step_ms']:.2f} ms: products "
          f"{breakdown['products_ms']:.2f} ms, the rest {breakdown['other_ms']:.2f} ms; "
          + ", ".join(f"{k} {v:.2f}" for k, v in breakdown["split_ms"].items()), flush=True)
    llama_bytes = gguf_step_bytes(model)
    out: dict[str, Any] = {
        "skyline_defaults": {"dtype": cfg.dtype, "quantization": cfg.quant.method},
        "skyline_cpu_kernels": llm.query("describe")["cpu_kernels"],  # of its one-row steps
        "memory_gib": {"file": os.path.getsize(model) / 2**30,
                       "skyline_weights": llm.query("describe")["weights_gib"],
                       "skyline_process_resident": resident_bytes() / 2**30},
        "decode_b1_tok_s": dec, "prefill_tok_s": pre, "decode_step_breakdown": breakdown,
        "decode_step_bytes": {"skyline": sky_bytes, "llama.cpp": llama_bytes},
        "decode_floor_tok_s": {"skyline": bandwidth / sky_bytes,
                               "llama.cpp": bandwidth / llama_bytes},
    }
    if dec["llama.cpp"]:
        out["decode_b1"] = ratio_summary(dec["skyline"], dec["llama.cpp"])
        out["prefill"] = ratio_summary(pre["skyline"], pre["llama.cpp"])
    del llm
    return out


def bench_serve(model: str, ns: argparse.Namespace) -> dict[str, Any]:
    flags = ["--model", model, "--threads", str(ns.threads)]
    workload = WorkloadSpec("random", str(ns.serve_in), str(ns.serve_out))
    log_dir = ns.work_dir
    sky_proc, sky_url = start_server(flags, os.path.join(log_dir, "skyline-serve.log"), 600.0)
    procs, urls = {"skyline": sky_proc}, {"skyline": sky_url}
    llama_cmd: list[str] = []
    try:
        if ns.llama_bin is not None:
            ls = llamacpp_serve()
            proc, url, llama_cmd = ls.start_llama_server(
                os.path.join(ns.llama_bin, "llama-server"), model, ns.threads, ns.streams,
                1024, os.path.join(log_dir, "llama-server.log"), 300.0)
            procs["llama.cpp"], urls["llama.cpp"] = proc, url
            cell = ls.run_cell(urls, "completions", workload, ns.streams,
                               ns.streams * ns.requests_per_stream, ns.rounds, seed=16)
        else:  # skyline alone
            load = LoadSpec(base_url=sky_url, concurrency=ns.streams, progress=False,
                            num_requests=ns.streams * ns.requests_per_stream, warmup=1)
            results, duration, _, _ = run_load(load, workload)
            cell = {"engines": {"skyline": summarize(results, duration)}}
    finally:
        for p in procs.values():
            stop_server(p)
    cell["skyline_command"] = shlex.join(["skyline", "serve", *flags])
    if llama_cmd:
        llama_cmd[llama_cmd.index("--port") + 1] = "<free>"
        cell["llama_server_command"] = shlex.join(llama_cmd)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=None, help="llama-bench, llama-server, llama-quantize")
    ap.add_argument("--smoke", action="store_true", help="skyline only, tiny settings (CI)")
    ap.add_argument("--models", default="q4_1,q4_k_m,q8_0",
                    help="q4_1, q4_k_m, q8_0, bf16, moe_q4_k_m, moe_tiny or a GGUF file's path")
    ap.add_argument("--parts", default="offline,serve",
                    help="offline (batch-1 decode and prefill), serve (the streams), or both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--gen-len", type=int, default=128, help="batch-1 decode tokens")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests-per-stream", type=int, default=2, help="per engine and round")
    ap.add_argument("--serve-in", type=int, default=64)
    ap.add_argument("--serve-out", type=int, default=128)
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "cpu-vs-llamacpp"),
                    help="made GGUF files and server logs")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/cpu/"
                    "cpu-vs-llamacpp-<N>threads.json; with --smoke none unless given)")
    ns = ap.parse_args()
    if ns.smoke:
        ns.models, ns.rounds, ns.prompt_len, ns.gen_len = "q4_1,moe_tiny", 1, 16, 8
        ns.streams, ns.requests_per_stream, ns.serve_in, ns.serve_out = 2, 1, 16, 8
        ns.llama_bin = None
    elif ns.llama_bin is None:
        raise SystemExit("give --llama-bin DIR (llama.cpp's binaries), or --smoke")
    out_path = ns.out or (None if ns.smoke else
                          f"bench/results/cpu/cpu-vs-llamacpp-{ns.threads}threads.json")
    os.makedirs(ns.work_dir, exist_ok=True)
    t_start = time.time()
    bandwidth = host_read_bandwidth(ns.threads)
    plan = cpu_plan.plan()
    report: dict[str, Any] = {
        "benchmark": "cpu-vs-llamacpp",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + shlex.join(sys.argv),
        "machine": machine_info("cpu") | {"load_avg_at_start": os.getloadavg()},
        "cpu_plan": {"family": plan.family, "dtype": str(plan.dtype).removeprefix("torch."),
                     "int4_rows": plan.int4_rows, "int4_wide_rows": plan.int4_wide_rows,
                     "intdot_rows": plan.intdot_rows, "int4_kernel": plan.int4_kernel,
                     "intdot_rounds": plan.intdot_rounds},
        "threads": ns.threads, "rounds": ns.rounds,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "settings": {"prefill_prompt_tokens": ns.prompt_len, "decode_tokens": ns.gen_len,
                     "serve_streams": ns.streams, "serve_input_tokens": ns.serve_in,
                     "serve_output_tokens": ns.serve_out,
                     "serve_requests_per_engine_and_round": ns.streams * ns.requests_per_stream},
        "models": {},
    }
    if ns.llama_bin is not None:
        server = os.path.join(ns.llama_bin, "llama-server")
        report["llama_cpp_version"] = llamacpp_serve().llama_version(server)
    for name in ns.models.split(","):
        model = model_file(name, ns.work_dir, ns.llama_bin)
        print(f"{name}: {model}", flush=True)
        entry = {"file": os.path.basename(model), "bytes": os.path.getsize(model)}
        if "offline" in ns.parts:
            entry |= bench_offline(model, ns, bandwidth)
        if "serve" in ns.parts:
            entry["serve"] = bench_serve(model, ns)
        report["models"][os.path.basename(name) if name.endswith(".gguf") else name] = entry
        _print_model(name, entry)
        if ns.smoke:
            _check_smoke(entry)
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    report["total_seconds"] = round(time.time() - t_start, 1)
    save_json(report, out_path)
    if out_path:
        print(f"-> {out_path}")


def _check_smoke(entry: dict[str, Any]) -> None:
    """A smoke run (CI's) fails unless every part measured something, every request done."""
    serve = entry["serve"]["engines"]["skyline"]
    figures = (entry["decode_b1_tok_s"]["skyline"][0], entry["prefill_tok_s"]["skyline"][0],
               entry["decode_floor_tok_s"]["skyline"], serve["output_throughput"],
               serve["ttft_ms"]["median"])
    if serve["failed"] or serve["completed"] != 2 or min(figures) <= 0:
        raise SystemExit(f"smoke run measured nothing: {figures}, serve {serve}")


def _print_model(name: str, entry: dict[str, Any]) -> None:
    serve = entry.get("serve", {}).get("engines", {})
    line = [f"{name}:"]
    for key, raw in (("decode_b1", "decode_b1_tok_s"), ("prefill", "prefill_tok_s")):
        if raw not in entry:
            continue
        if key in entry:
            s = entry[key]
            line.append(f"{key} {s['skyline_median']:.1f} / {s['llamacpp_median']:.1f} tok/s "
                        f"({s['ratio_of_medians']:.2f}x)")
        else:
            line.append(f"{key} skyline {statistics.median(entry[raw]['skyline']):.1f} tok/s")
    for engine, s in serve.items():
        line.append(f"serve {engine} {s['output_throughput']:.1f} tok/s TTFT p50 "
                    f"{s['ttft_ms']['median']:.0f} ms")
    print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
