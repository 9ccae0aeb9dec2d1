"""Quality of GGUF quantization types on the default model, measured by llama.cpp and by skyline
on the same files, the same tokens and the same protocol.

    python bench/llamacpp_quality.py --llama-bin /path/to/llama.cpp/build/bin \
        [--work-dir /work/gguf-variants]
        [--out bench/results/llamacpp/llamacpp-quality-cpu-smollm2.json]
    python bench/llamacpp_quality.py --smoke   # skyline's side only, a tiny random model

Reference: the embedded model (SmolLM2-135M-Instruct Q4_1 GGUF) dequantized to an F32 GGUF
(`llama-quantize --allow-requantize model.gguf ref-f32.gguf F32`); each type (Q8_0, Q6_K, ...)
is quantized from that F32 file by `llama-quantize`. The generated files live in --work-dir,
outside the repository, and are reused when present.

llama.cpp: `llama-perplexity -c N --kl-divergence-base` on the reference (which stores its
tokens and log-probs), then `--kl-divergence` for each type; parsed: perplexity, mean KL
divergence KL(reference || type) and "Same top p" (top-1 agreement).

skyline: the same GGUF files loaded by skyline (dequantized to float32 at load; for
--packed types also kept packed with `--quantization gguf`), run on llama.cpp's own token ids
(read from the KL base file; skyline's tokenization of the text is compared with them and the
result recorded) in the same windows: independent chunks of N tokens, the first replaced by BOS
when the model asks for one, every token of the second half of each chunk scored (the last
logit of a chunk has no target). KL is the exact sum over the vocabulary against skyline's own
F32 reference; llama.cpp stores its reference log-probs as 16-bit codes and skips vocabulary
entries below e^-16, which changes KL by well under 1e-4 here. A cross-check row compares the
two engines' references directly (llama.cpp's stored log-probs against skyline's).

Text: skyline/tools/calibration.txt (public domain), all of it by default (5 chunks of 512, 1,275
scored tokens). About 5 minutes with `--threads 1` on the shared 2-core machine, the GGUF files
already made (making them adds about a minute).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import tiny_model
from skyline.engine.create import resolve_model_path
from skyline.engine.frontend.llm import LLM
from skyline.engine.frontend.tokenizer import Tokenizer

TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0")
TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "skyline", "tools", "calibration.txt")


def sh(cmd: list[str], log: str) -> str:
    """Run a llama.cpp tool; its output is kept in `log` and returned."""
    print("$", shlex.join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace")
    with open(log, "w") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed (exit {p.returncode}); see {log}:\n{p.stdout[-800:]}")
    return p.stdout


def tensor_types(path: str) -> dict[str, int]:
    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def read_kld_base(path: str) -> tuple[int, list[int], np.ndarray]:
    """llama-perplexity's --kl-divergence-base file: (n_ctx, tokens, log-probs of the scored
    positions as float32 [n_chunk * (n_ctx - 1 - n_ctx // 2), n_vocab])."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{path} is not a llama-perplexity KL base file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).tolist()
        nv = 2 * ((n_vocab + 1) // 2) + 4
        rows = np.frombuffer(f.read(), dtype=np.uint16).reshape(-1, nv)
    # Each row: float32 scale, float32 min log-prob, 2 pad words, then one uint16 code per token.
    head = rows[:, :4].copy().view(np.float32)  # [rows, 2]
    logp = rows[:, 4 : 4 + n_vocab].astype(np.float32) * head[:, :1] + head[:, 1:2]
    return int(n_ctx), tokens, logp


def parse_ppl_base(out: str) -> float:
    m = re.search(r"Final estimate: PPL = ([\d.]+)", out)
    if not m:
        raise SystemExit("no 'Final estimate: PPL' in llama-perplexity's output")
    return float(m.group(1))


def parse_kld(out: str) -> dict[str, float]:
    pats = {"perplexity": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "kl": r"Mean\s+KLD:\s*([-\d.]+)",
            "kl_p99": r"99\.0%\s+KLD:\s*([-\d.]+)",
            "top1_agreement": r"Same top p:\s*([\d.]+)"}
    res = {}
    for k, p in pats.items():
        m = re.search(p, out)
        if not m:
            raise SystemExit(f"no {p!r} in llama-perplexity's output")
        res[k] = float(m.group(1))
    res["top1_agreement"] /= 100.0  # printed in percent
    return res


@torch.no_grad()
def skyline_logprobs(path: str, chunks: list[list[int]], first: int, threads: int,
                     quantization: str | None, load_format: str = "auto") -> torch.Tensor:
    """skyline's log-probs at the scored positions of every chunk: [n_scored, vocab]."""
    n_ctx = len(chunks[0])
    llm = LLM(model=path, load_format=load_format, dtype="float32", device="cpu",
              max_model_len=n_ctx, num_blocks=n_ctx // 16 + 2, max_num_seqs=1, threads=threads,
              quantization=quantization)
    out = [llm.query("score", c)[first : n_ctx - 1] for c in chunks]
    del llm
    gc.collect()
    return torch.cat(out)


def compare(logq: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor,
            floor: float | None = None) -> dict[str, float]:
    """Perplexity of q on the targets, mean KL(ref || q), p99 KL and top-1 agreement; with a
    floor, vocabulary entries whose reference log-prob is at or below it are left out of KL (as
    llama-perplexity does for its 16-bit reference)."""
    nll = -logq.gather(1, targets[:, None]).squeeze(1)
    terms = ref.exp() * (ref - logq)  # [n, vocab]
    if floor is not None:
        terms = terms.masked_fill(ref <= floor, 0.0)
    kl = terms.sum(-1)
    return {"perplexity": math.exp(float(nll.double().mean())), "kl": float(kl.mean()),
            "kl_p99": float(kl.quantile(0.99)),
            "top1_agreement": float((logq.argmax(-1) == ref.argmax(-1)).float().mean())}


def smoke(threads: int) -> None:
    """skyline's side of the protocol on a tiny random model (no llama.cpp): its reference and
    INT8 weights scored on its own tokens of the text, in chunks of 32, the second half of
    each scored."""
    print("llamacpp_quality --smoke: no llama.cpp; its side is skipped, skyline's runs on a "
          "tiny random model", flush=True)
    path, n_ctx = tiny_model(), 32
    with open(TEXT, encoding="utf-8") as f:
        ids = Tokenizer.load(path).encode(f.read())
    chunks = [ids[s : s + n_ctx] for s in range(0, 2 * n_ctx, n_ctx)]
    first = n_ctx // 2
    targets = torch.tensor([t for c in chunks for t in c[first + 1 : n_ctx]])
    ref = skyline_logprobs(path, chunks, first, threads, None, "dummy")
    for quantization in (None, "int8"):
        logq = skyline_logprobs(path, chunks, first, threads, quantization, "dummy")
        print(quantization or "reference", "skyline", compare(logq, ref, targets), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=None,
                    help="folder holding llama-quantize and llama-perplexity (required)")
    ap.add_argument("--work-dir", default="/work/gguf-variants")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--packed", default="Q4_K_M,Q5_0",
                    help="types also scored by skyline with --quantization gguf")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=-1, help="chunks of the text (-1: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--rebuild", action="store_true", help="requantize even if files exist")
    ap.add_argument("--out", default="bench/results/llamacpp/llamacpp-quality-cpu-smollm2.json")
    ap.add_argument("--smoke", action="store_true",
                    help="skyline's side only, on a tiny random model, no JSON")
    ns = ap.parse_args()
    if ns.smoke:
        smoke(ns.threads)
        return
    if ns.llama_bin is None:
        ap.error("--llama-bin is required")
    types = [t for t in ns.types.split(",") if t]
    packed = [t for t in ns.packed.split(",") if t]
    if bad := [t for t in packed if t not in types]:
        raise SystemExit(f"--packed {bad[0]} is not among --types")
    quantize = os.path.join(ns.llama_bin, "llama-quantize")
    perplexity = os.path.join(ns.llama_bin, "llama-perplexity")
    for tool in (quantize, perplexity):
        if not os.access(tool, os.X_OK):
            raise SystemExit(f"{tool} not found; pass --llama-bin with llama.cpp's built tools")
    os.makedirs(ns.work_dir, exist_ok=True)
    logs = os.path.join(ns.work_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    t_start = time.time()
    commands: list[str] = []

    def run(cmd: list[str], name: str) -> str:
        commands.append(shlex.join(cmd))
        return sh(cmd, os.path.join(logs, name + ".log"))

    # 1. The F32 reference and one file per type, all made by llama-quantize.
    src = resolve_model_path(None, "auto")  # the embedded default model
    files = {"F32": os.path.join(ns.work_dir, "ref-f32.gguf")}
    files |= {t: os.path.join(ns.work_dir, f"smollm2-135m-{t}.gguf") for t in types}
    if ns.rebuild or not os.path.exists(files["F32"]):
        run([quantize, "--allow-requantize", src, files["F32"], "F32", str(ns.threads)],
            "quantize-F32")
    for t in types:
        if ns.rebuild or not os.path.exists(files[t]):
            run([quantize, files["F32"], files[t], t, str(ns.threads)], f"quantize-{t}")

    # 2. llama.cpp's figures.
    base = os.path.join(ns.work_dir, f"ref-f32-c{ns.ctx}.kld")
    common = ["-c", str(ns.ctx), "-b", str(ns.ctx), "-t", str(ns.threads),
              "--chunks", str(ns.chunks)]
    t0 = time.time()
    out = run([perplexity, "-m", files["F32"], "-f", ns.text, *common,
               "--kl-divergence-base", base], "perplexity-F32")
    llama: dict[str, dict[str, Any]] = {"F32": {"perplexity": parse_ppl_base(out)}}
    for t in types:
        out = run([perplexity, "-m", files[t], "--kl-divergence-base", base, "--kl-divergence",
                   *common], f"perplexity-{t}")
        llama[t] = parse_kld(out)
        print(t, "llama.cpp", llama[t], flush=True)
    llama_seconds = time.time() - t0

    # 3. skyline on llama.cpp's tokens and windows.
    n_ctx, tokens, base_logp = read_kld_base(base)
    first = n_ctx // 2
    fields = GGUFReader(files["F32"]).fields
    chunks = [tokens[s : s + n_ctx] for s in range(0, len(tokens), n_ctx)]
    if "tokenizer.ggml.add_bos_token" in fields and \
            fields["tokenizer.ggml.add_bos_token"].contents():
        bos = int(fields["tokenizer.ggml.bos_token_id"].contents())
        chunks = [[bos, *c[1:]] for c in chunks]
    targets = torch.tensor([t for c in chunks for t in c[first + 1 : n_ctx]])
    with open(ns.text, encoding="utf-8") as f:
        text = f.read()
    sky_ids = Tokenizer.load(files["F32"]).encode(text)
    same_tokens = sky_ids[: len(tokens)] == tokens
    mismatch = next((i for i, (a, b) in enumerate(zip(sky_ids, tokens, strict=False))
                     if a != b), None)
    print(f"{len(chunks)} chunks of {n_ctx}, {len(targets)} scored tokens; skyline's "
          f"tokenization equals llama.cpp's: {same_tokens}", flush=True)

    t0 = time.time()
    ref = skyline_logprobs(files["F32"], chunks, first, ns.threads, None)
    sky: dict[str, dict[str, Any]] = {"F32": compare(ref, ref, targets)}
    # skyline's reference against llama.cpp's, with llama.cpp's KL formula (floor e^-16).
    cross = compare(ref, torch.from_numpy(base_logp), targets, floor=-16.0)
    cross["perplexity_llamacpp"] = llama["F32"]["perplexity"]
    for t in types:
        sky[t] = compare(skyline_logprobs(files[t], chunks, first, ns.threads, None),
                         ref, targets)
        print(t, "skyline", sky[t], flush=True)
    sky_packed = {}
    for t in packed:
        sky_packed[t] = compare(skyline_logprobs(files[t], chunks, first, ns.threads, "gguf"),
                                ref, targets)
        print(t, "skyline packed", sky_packed[t], flush=True)
    sky_seconds = time.time() - t0

    def rnd(d: dict[str, Any]) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}

    rows = []
    for t in ["F32", *types]:
        row = {"type": t, "file_mib": round(os.path.getsize(files[t]) / 2**20, 1),
               "tensor_types": tensor_types(files[t]), "llama.cpp": rnd(llama[t]),
               "skyline": rnd(sky[t])}
        if t in sky_packed:
            row["skyline_packed"] = rnd(sky_packed[t])
        rows.append(row)
    report = {
        "benchmark": "llamacpp-quality",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + shlex.join(sys.argv),
        "machine": machine_info("cpu"),
        "llama_cpp_commands": commands,
        "model": src,
        "reference": "the embedded Q4_1 model dequantized to F32 by llama-quantize",
        "text": os.path.relpath(ns.text),
        "text_tokens": len(sky_ids),
        "ctx": n_ctx, "chunks": len(chunks), "scored_tokens": len(targets),
        "protocol": "llama-perplexity's: independent chunks of ctx tokens (BOS first when the "
                    "model adds one), the second half of each chunk scored; skyline runs on "
                    "llama.cpp's token ids; KL = mean KL(reference || type), each engine against "
                    "its own F32 reference",
        "skyline_tokens_equal_llamacpp": same_tokens,
        "first_token_mismatch": mismatch,
        "cross_check_reference": {
            "what": "skyline's F32 reference against llama.cpp's stored F32 reference log-probs "
                    "(16-bit codes): KL(llama.cpp || skyline), top-1 agreement; skyline's "
                    "perplexity beside llama.cpp's",
            **rnd(cross)},
        "llama_cpp_seconds": round(llama_seconds, 1),
        "skyline_seconds": round(sky_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "results": rows,
    }
    save_json(report, ns.out)
    print("\n| type | file MiB | llama.cpp PPL | skyline PPL | llama.cpp KL | skyline KL | "
          "llama.cpp top-1 | skyline top-1 |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["llama.cpp"], r["skyline"]
        kl = f"{a['kl']:.5f}" if "kl" in a else "0 (base)"
        top = f"{a['top1_agreement']:.4f}" if "top1_agreement" in a else "1 (base)"
        print(f"| {r['type']} | {r['file_mib']} | {a['perplexity']:.4f} | "
              f"{b['perplexity']:.4f} | {kl} | {b['kl']:.5f} | {top} | "
              f"{b['top1_agreement']:.4f} |")
    print("cross-check:", rnd(cross))
    print(f"-> {ns.out} ({report['total_seconds']} s)")


if __name__ == "__main__":
    main()
