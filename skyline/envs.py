"""Every environment variable skyline reads, typed, read once.

`ENV` is read when this module is first imported and never changes afterwards (except in a
benchmark's engine: the query "unfuse" of worker/queries.py swaps `unfuse` between runs, and
the runner's shutdown puts it back); code reads `envs.ENV.<name>`, never `os.environ`. Tests
that need another value replace `envs.ENV` (`monkeypatch.setattr(envs, "ENV",
envs.Env.read())` after setting the variable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# OpenMP's wait policy in skyline's processes unless the user set one: idle workers spin a few
# microseconds (GOMP_SPINCOUNT iterations), then sleep. Spinning workers (OpenMP's default)
# make CPU decode several times slower whenever another process wants a core, workers that
# sleep at once (PASSIVE alone) are woken for each of a step's hundreds of parallel regions
# (bench/omp_wait_policy.py). OpenMP reads it once, when torch loads it: the CLI sets it before
# anything imports torch, the multi-process executor around starting its ranks.
OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "2000"}


def omp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What of OMP_DEFAULTS to add to `environ`: all of it, or nothing where the user set
    either variable."""
    return {} if any(k in environ for k in OMP_DEFAULTS) else dict(OMP_DEFAULTS)


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} must be a whole number"
                         ) from None


# The fusions of the CUDA path that SKYLINE_UNFUSE can replace by their modular forms (two or
# more launches: torch ops or the unfused kernels), to measure what each fusion buys
# (bench/fused_vs_modular.py). Each name's form lives beside its fused kernel:
#   norm       residual add + RMSNorm (ops/norm.py): torch's add, then the plain RMSNorm kernel
#   rope_kv    rotary + KV-cache write (ops/rotary.py): the rotary kernel, then write_kv's
#   qk_norm    Qwen3's per-head q/k RMSNorm + rotary (ops/rotary.py): the RMSNorm kernel first
#   silu       SiLU-and-mul and gpt-oss's clamped SwiGLU (ops/activation.py): torch's ops
#   act_quant  activations quantized by their producer (norm, SiLU, attention's combine) for
#              a W8A8 / W4A8 GEMV or W8A8's _scaled_mm (model/layers/linear.py): the product
#              quantizes them itself
#   moe_route  MoE softmax + top-k in one launch (ops/moe_route.py): torch's softmax and topk
#   moe_align  the MoE's pairs sorted into expert blocks in four launches (ops/moe_align.py):
#              torch's argsort and ~30 small ops
#   moe_gemv   the MoE decode GEMVs with SwiGLU and routing weights in them (ops/moe.py): the
#              grouped GEMMs, a separate activation and top-k sum
#   argmax     greedy sampling's argmax kernel (ops/argmax.py): torch.argmax
#   nucleus    top-p draws without a sort (ops/nucleus.py): the sorted vocabulary
#   pdl        programmatic dependent launch (ops/pdl.py; as SKYLINE_PDL=0)
FUSIONS = ("norm", "rope_kv", "qk_norm", "silu", "act_quant", "moe_route", "moe_align",
           "moe_gemv", "argmax", "nucleus", "pdl")


def parse_unfuse(value: str) -> frozenset[str]:
    """A comma list of FUSIONS names ("" or "none": none) as a set; an unknown name is refused
    in one sentence that lists the known ones."""
    names = {n.strip() for n in value.split(",")} - {"", "none"}
    unknown = sorted(names - set(FUSIONS))
    if unknown:
        raise ValueError(f"SKYLINE_UNFUSE names unknown fusions {', '.join(unknown)}; the known "
                         f"ones are {', '.join(FUSIONS)}")
    return frozenset(names)


@dataclass(frozen=True)
class Env:
    # TRITON_INTERPRET=1: Triton kernels run in Triton's CPU interpreter (kernel tests without
    # a GPU); kernels then avoid what the interpreter cannot run (pipelined range loops, PTX).
    triton_interpret: bool
    # SKYLINE_PDL=0: no programmatic dependent launch for the Triton kernels (ops/pdl.py).
    pdl: bool
    # SKYLINE_CPU_SERIAL_TOKENS: on a CPU, a step of at most this many tokens runs on one
    # thread or on all, whichever its size ran faster on lately (worker/runner/step_threads.py);
    # 0: every step on all threads.
    cpu_serial_tokens: int
    # SKYLINE_GGUF_CPU_PLANES: on a CPU in bfloat16, GGUF blocks of at most this many bits
    # above 4 run the int4 kernel as two planes (quant/gguf.py); 1 keeps them dense.
    gguf_cpu_planes: int
    # SKYLINE_CPU_INTDOT=0: the CPU plan never builds nor runs the integer dot-product kernel
    # (ops/cpu_intdot.py); torch's kernels serve every product.
    cpu_intdot: bool
    # SKYLINE_CPU_INTDOT_ROUNDS=1 or 2: times that kernel rounds the activations to int8, over
    # the CPU plan's choice (ops/cpu_plan.py: once on AVX2, else twice); 0 (default): the plan's.
    cpu_intdot_rounds: int
    # SKYLINE_CPU_BF16_ROWS=N: batches of at most N rows run bfloat16 weights on skyline's bf16
    # kernel (ops/cpu_bf16.py), over the CPU plan's bf16_rows; 0 (or unset): the plan's; -1: never
    cpu_bf16_rows: int
    # SKYLINE_HUGE_PAGES=0: a CPU engine's streamed weights stay in torch's allocations instead
    # of a mapping advised to transparent huge pages (ops/host_memory.py)
    huge_pages: bool
    # SKYLINE_CPU_INTDOT_MARCH: the -march that kernel is built for (default "native"; tests
    # build "haswell" and "x86-64" to check its AVX2 and scalar paths).
    cpu_intdot_march: str
    # SKYLINE_API_KEY: the server's API key when --api-key is not given.
    api_key: str | None
    # OPENAI_API_KEY: the key `skyline bench serve` sends when --api-key is not given.
    openai_api_key: str | None
    # SKYLINE_KERNEL_CACHE: the folder of this user's tuned kernel configs (`skyline tune`),
    # read after the shipped tables of skyline/ops/configs/ (default
    # $XDG_CACHE_HOME/skyline/kernels, else ~/.cache/skyline/kernels).
    kernel_cache_dir: str
    # SKYLINE_STEP_TRACE: a file: the engine-core process of `skyline serve` records every
    # step's shape and seconds (engine/step_trace.py) and writes their summary there, as JSON,
    # when it stops (bench/served_vs_offline.py); default none.
    step_trace: str | None = None
    # SKYLINE_UNFUSE: FUSIONS (above) that run in their modular form, e.g. "norm,silu"; default
    # none. For measurement: a benchmark's engine may change it between runs (worker/queries.py,
    # "unfuse"), so code reads it at each call, not once.
    unfuse: frozenset[str] = frozenset()
    # SKYLINE_MOE_DECODE_PAIRS: MXFP4 MoE experts are decoded to bf16 before the grouped GEMMs
    # in calls of at least this many (token, expert) pairs (ops/moe.py); unset (-1): the
    # measured DECODE_PAIRS there, 0: never (every tile decoded inside the GEMM).
    moe_decode_pairs: int = -1
    # SKYLINE_DENSE_PREFILL_TOKENS=N: on a GPU, extends of at least N query tokens (and of
    # DENSE_MIN_WORK query x context pairs) run through torch's cuDNN attention over their
    # gathered K/V (ops/attention_dense.py); unset: its DENSE_MIN_QUERY (2,048, measured by
    # bench/kernels/prefill_attention_speed.py); 0: every extend on the paged Triton kernels.
    dense_prefill_tokens: int = -1

    @classmethod
    def read(cls) -> Env:
        return cls(
            triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
            pdl=_flag("SKYLINE_PDL", True),
            cpu_serial_tokens=_int("SKYLINE_CPU_SERIAL_TOKENS", 4),
            gguf_cpu_planes=_int("SKYLINE_GGUF_CPU_PLANES", 2),
            cpu_intdot=_flag("SKYLINE_CPU_INTDOT", True),
            cpu_intdot_rounds=_int("SKYLINE_CPU_INTDOT_ROUNDS", 0),
            cpu_bf16_rows=_int("SKYLINE_CPU_BF16_ROWS", 0),
            huge_pages=_flag("SKYLINE_HUGE_PAGES", True),
            cpu_intdot_march=os.environ.get("SKYLINE_CPU_INTDOT_MARCH") or "native",
            api_key=os.environ.get("SKYLINE_API_KEY") or None,
            openai_api_key=os.environ.get("OPENAI_API_KEY") or None,
            kernel_cache_dir=os.environ.get("SKYLINE_KERNEL_CACHE") or os.path.join(
                os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache"),
                "skyline", "kernels"),
            step_trace=os.environ.get("SKYLINE_STEP_TRACE") or None,
            unfuse=parse_unfuse(os.environ.get("SKYLINE_UNFUSE", "")),
            moe_decode_pairs=_int("SKYLINE_MOE_DECODE_PAIRS", -1),
            dense_prefill_tokens=_int("SKYLINE_DENSE_PREFILL_TOKENS", -1),
        )


ENV = Env.read()
