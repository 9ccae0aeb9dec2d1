"""Time from nothing to serving an 8B model on one GPU, by phase, with Triton's cache empty (a
first start on a new machine) and filled (every later start).

  python bench/fast_start.py --model llama-3.1-8b --dir /tmp/llama-8b-ckpt
  python bench/fast_start.py --smoke   # a tiny random model on the CPU: the code only

First writes a bf16 safetensors checkpoint of the model's shape (random weights, Hugging Face
tensor names, 5 GB shards, and a word-level tokenizer of its vocabulary) unless `--dir` already
holds one. Then, each start in a fresh process and with TRITON_CACHE_DIR a new empty directory
for the first start of each kind:
  engine  the engine built in its process from the checkpoint, as `LLM(...)` does (twice: Triton
          cache empty, then filled by the first): each phase's seconds as the engine records
          them (the process's imports, config, tokenizer, weights, profile run, KV cache, CUDA
          graphs with every graph's warm-up and capture, the Triton compilations) and the total;
  serve   a `skyline serve` process, timed from its spawn to its first 200 on /health (twice, the
          same way), with the phases its log reports (the engine process's, then the API's).
The checkpoint was just written (or read), so it is read from the page cache (a warm restart);
a cold start adds the disk's read time for its size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import torch
from safetensors.torch import save_file

from skyline.bench.dummy_model import build_tokenizer
from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.config import ModelArch
from skyline.configs import dummy_config_dir
from skyline.types.startup import process_seconds

START_TIMEOUT_S = 300  # a start that takes longer has failed


def hf_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
    h, kv, hd = a.hidden_size, a.num_kv_heads * a.head_dim, a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, h)
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (a.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, a.num_heads * hd),
            p + "mlp.gate_proj.weight": (a.intermediate_size, h),
            p + "mlp.up_proj.weight": (a.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, a.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
        if a.architecture == "Qwen3ForCausalLM":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def write_checkpoint(model: str, out: str, device: str, shard_bytes: int = 5 << 30) -> float:
    src = dummy_config_dir(model) or model
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), out)
    with open(os.path.join(out, "config.json")) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    t0 = time.perf_counter()
    shard: dict[str, torch.Tensor] = {}
    size, n = 0, 0
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in hf_shapes(arch).items():
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        t.normal_(0, 0.02, generator=gen) if len(shape) == 2 else t.fill_(1.0)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size >= shard_bytes:
            save_file(shard, os.path.join(out, f"model-{n:05d}.safetensors"))
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, os.path.join(out, f"model-{n:05d}.safetensors"))
    return time.perf_counter() - t0


def write_tokenizer(out: str) -> None:
    """A word-level tokenizer of the model's vocabulary (serve needs one; its load is timed)."""
    with open(os.path.join(out, "config.json")) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    build_tokenizer(arch.vocab_size, arch.bos_token_id, list(arch.eos_token_ids)).save(
        os.path.join(out, "tokenizer.json"))


def engine_kwargs(a: argparse.Namespace, device: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_model_len": a.max_model_len,
                          "speculative_method": a.speculative_method, "device": device}
    return kw | ({"kv_cache_memory": "64MiB"} if a.smoke else {})


def one_start(a: argparse.Namespace, device: str) -> dict[str, Any]:
    """The engine built in this (fresh) process: its phases, this process's imports first."""
    before = process_seconds() or 0.0  # the interpreter, torch and this script's imports
    t0 = time.perf_counter()
    from skyline.engine.frontend.llm import LLM

    t1 = time.perf_counter()
    llm = LLM(a.dir, **engine_kwargs(a, device))
    ready = before + time.perf_counter() - t0
    info = llm.query("describe")
    phases = {"imports": before + t1 - t0, **llm.startup}  # LLM's phases add up to its time
    llm.shutdown()
    return {
        "engine_ready_s": ready, "phases_s": phases,
        "cuda_graph_times": info["cuda_graph_times"], "num_cuda_graphs": info["num_cuda_graphs"],
        "num_mixed_cuda_graphs": info["num_mixed_cuda_graphs"],
        "cuda_graph_warmup_s": sum(g["warmup_s"] for g in info["cuda_graph_times"]),
        "cuda_graph_capture_only_s": sum(g["capture_s"] for g in info["cuda_graph_times"]),
        "triton_compiles": info["triton_compiles"],
        "triton_compile_s": info["triton_compile_seconds"],
        "load_weights_s": info["load_seconds"],
        "cuda_graph_capture_s": info["cuda_graph_capture_seconds"],
    }


def run_engine_start(a: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    """`one_start` in a new process (nothing of Triton's in memory) with `cache_dir`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv = [sys.executable, os.path.abspath(__file__), "--one-start", "--dir", a.dir,
            "--max-model-len", str(a.max_model_len),
            "--speculative-method", a.speculative_method, "--out", out]
    env = os.environ | {"TRITON_CACHE_DIR": cache_dir}
    t0 = time.perf_counter()
    r = subprocess.run(argv + (["--smoke"] if a.smoke else []), env=env, text=True,
                       capture_output=True, timeout=START_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"the engine start failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res | {"process_wall_s": wall}  # with the interpreter's exit and this script's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


PHASES_LINE = re.compile(r"start-up phases (\{.*\})")


def serve_start(a: argparse.Namespace, device: str, cache_dir: str) -> dict[str, Any]:
    """A `skyline serve` process from its spawn to its first 200 on /health, then stopped."""
    port = _free_port()
    argv = [sys.executable, "-m", "skyline.cli", "serve", "--model", a.dir, "--port", str(port),
            "--max-model-len", str(a.max_model_len), "--device", device,
            "--speculative-method", a.speculative_method]
    if a.smoke:
        argv += ["--kv-cache-memory", "64MiB", "--threads", "1"]
    env = os.environ | {"TRITON_CACHE_DIR": cache_dir}
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}/health"
        health = None
        try:
            while time.perf_counter() - t0 < START_TIMEOUT_S and proc.poll() is None:
                if _healthy(url):
                    health = time.perf_counter() - t0
                    break
                time.sleep(0.02)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
    if health is None:
        raise SystemExit(f"skyline serve did not become healthy:\n{text[-4000:]}")
    m = PHASES_LINE.search(text)
    phases = json.loads(m.group(1)) if m else {}
    return {"health_s": health, "phases_s": phases,
            # the log's total against the outside clock: what no phase recorded (the last
            # poll's wait, uvicorn's start after the app's)
            "unrecorded_s": health - sum(phases.values()) if phases else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "skyline-fast-start"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--speculative-method", default="none",
                    help="ngram/suffix/...: also captures the verification-step graphs")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model's checkpoint, on the CPU without a GPU")
    ap.add_argument("--one-start", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    device = bench_device("fast_start", a.smoke)
    if a.one_start:  # a child of this script: one engine start, its record to --out
        res = one_start(a, device)
        with open(a.out, "w") as f:
            json.dump(res, f)
        return
    if a.smoke:
        a.max_model_len = 512
        a.model, a.dir = tiny_model(), tempfile.mkdtemp(prefix="skyline-smoke-")
    write_s = None
    if not os.path.isdir(a.dir) or not any(f.endswith(".safetensors") for f in os.listdir(a.dir)):
        write_s = write_checkpoint(a.model, a.dir, device)
        if device == "cuda":  # the starts below size their KV cache from the memory left free
            torch.cuda.empty_cache()
    if not os.path.exists(os.path.join(a.dir, "tokenizer.json")):
        write_tokenizer(a.dir)
    ckpt_gb = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir)
                  if f.endswith(".safetensors")) / 1e9
    engine: dict[str, Any] = {}
    serve: dict[str, Any] = {}
    for kind, runs in (("engine", engine), ("serve", serve)):
        cache = tempfile.mkdtemp(prefix="skyline-triton-cache-")
        # The second start finds the first's kernels. A CPU compiles none: its smoke run
        # starts serve once (seconds saved in CI).
        states = ("empty",) if a.smoke and kind == "serve" else ("empty", "filled")
        for state in states:
            runs[state] = (run_engine_start(a, cache) if kind == "engine"
                           else serve_start(a, device, cache))
            r = runs[state]
            total = r["engine_ready_s"] if kind == "engine" else r["health_s"]
            print(f"== {kind}, Triton cache {state}: {total:.2f} s = "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
                  + (f"; {r['num_cuda_graphs']} graphs: warm-up {r['cuda_graph_warmup_s']:.2f}"
                     f" s, capture {r['cuda_graph_capture_only_s']:.2f} s; "
                     f"{r['triton_compiles']} Triton compiles {r['triton_compile_s']:.2f} s"
                     if kind == "engine" else ""), flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    warm = engine["filled"]
    res = {
        "benchmark": "fast_start", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": a.model, "speculative_method": a.speculative_method,
        "max_model_len": a.max_model_len, "checkpoint_GB": ckpt_gb,
        "checkpoint_write_s": write_s,
        # every later start (Triton's cache filled), as this file's earlier versions measured
        "load_weights_s": warm["load_weights_s"],
        "cuda_graph_capture_s": warm["cuda_graph_capture_s"],
        "num_cuda_graphs": warm["num_cuda_graphs"],
        "num_mixed_cuda_graphs": warm["num_mixed_cuda_graphs"],
        "engine_ready_s": warm["engine_ready_s"],
        "load_GBps": ckpt_gb / warm["load_weights_s"],
        "health_s": {state: serve[state]["health_s"] for state in serve},
        "engine_ready_by_cache_s": {state: engine[state]["engine_ready_s"] for state in engine},
        "engine": engine, "serve": serve,
        "machine": machine_info(device),
    }
    if a.smoke:
        shutil.rmtree(a.dir, ignore_errors=True)
    print(json.dumps({k: v for k, v in res.items() if k not in ("engine", "serve")}, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
