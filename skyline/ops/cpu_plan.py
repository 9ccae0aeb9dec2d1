"""Which CPU kernels this machine runs fastest: a plan chosen from what the CPU, ATen and oneDNN
report, so that a GGUF model takes its fast path with no flags.

Four x86 families differ in what is native (`bench/cpu_kernel_plan.py` measures each kernel on
the default model's shapes, the families emulated on one machine with ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA):

- AMX and AVX-512 BF16: bfloat16 products are native, so activations, the KV cache and dense
  weights are bfloat16 (oneDNN packs them), and 4-bit GGUF codes run torch's int4 kernel
  (`ops/cpu_int4.py`) for decode-sized batches, where it reads a third of the bytes of dense
  bf16. Wider codes (Q5/Q8) would need two kernel calls, which lose to one dense bf16 product.
- AVX-512 without BF16 (VNNI: Cascade Lake, Ice Lake): oneDNN emulates bf16, 2.5x slower than
  float32 at 16 rows, so activations stay float32 and only the int4 kernel's input is rounded
  to bfloat16 (its AVX-512 path converts it to float32 in registers): 4-bit codes as one plane,
  5- to 8-bit codes as two, against 32 bits a weight for dense float32.
- AVX2 only: torch's int4 kernel's AVX2 path is slow (one row of the default model's layers
  8.8 ms, 3.7x its floor, bench/cpu_intdot_speed.py), and dense products are float32. The
  integer dot kernel, with activations rounded once (`intdot_rounds = 1`: without VNNI a second
  round doubles the work that bounds it at more than one row), runs 4-bit codes for up to 32
  rows (`int4_kernel = "intdot"`: the layers at 1 / 8 / 16 / 32 rows 3.6 / 12.1 / 22.8 / 41.1
  ms, against dense float32's 20.0 / 29.2 / 41.1 / 62.4) and 5- to 8-bit codes and the LM head
  for up to 16 (8-bit codes 4.5 / 16.6 / 31.5 ms at 1 / 8 / 16 rows, 61.0 at 32: no faster).
  One round is llama.cpp's rounding, about bfloat16 activations' error (top-1 agreement with
  the exact model 0.97, as the AVX-512 BF16 plan's; bench/cpu_decode_quality.py).

Everywhere the integer dot-product kernel builds (ops/cpu_intdot.py: activations rounded to int8
per 32 elements, as llama.cpp's CPU kernels, twice unless the plan says once), 5- to 8-bit codes
and the LM head of a GGUF model take it for batches of up to `intdot_rows` rows: on an AVX-512
VNNI machine it runs 8-bit codes
at 1.3-1.9x dense bf16's speed for one row (the Q8_0 head likewise), closer to the exact model
than bf16 products (bench/cpu_decode_quality.py); 4-bit codes stay on torch's int4 kernel,
which is faster there (not on AVX2, above), and more rows on dense products
(bench/cpu_intdot_speed.py).

Everywhere, batches above `int4_rows` (prefill, many streams) run dense oneDNN products on
weights dequantized once at load: the int4 kernel's time grows with the rows (it unpacks the
codes per block of rows) where a dense product's barely does. Integer dot products on int8
activations (oneDNN / fbgemm / `torch._int_mm`: 1.5-4x faster than these) are not used: torch
exposes them with one activation scale per row or tensor only, and rounding SmolLM2's
activations per row costs a KL of 0.057 against the GGUF weights (top-1 agreement 0.88), thirty
times the int4 kernel's bf16 rounding; llama.cpp rounds them per 32 elements (KL 0.005).

SKYLINE_CPU_INTDOT_ROUNDS=2 (or 1) sets the rounding count over the plan's, SKYLINE_CPU_BF16_ROWS
the bf16 kernel's rows (-1: never); `--dtype float32` is the exact path everywhere. On AVX-512
BF16, one rounding (llama.cpp's) also moves 4-bit codes to the integer dot kernel, for up to 8
rows as 5- to 8-bit codes: the default model's batch-1 decode 1.32x faster (205 against 156
tok/s, bench/cpu_vs_llamacpp.py), its KL against the exact model 1.5x the default plan's
(bench/cpu_decode_quality.py).

`skyline tune` measures these choices on the user's own CPU and stores what won end to end in
the per-device kernel cache (ops/tuning.py, kernel "cpu_plan", keyed by family): stored fields
override the table below (`int4_rows`, `int4_wide_rows`, `intdot_rows`, `intdot_rounds`,
`bf16_rows`, `threads`, `dtype`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from skyline import envs
from skyline.ops import cpu_intdot, cpu_linear, tuning

FAMILIES = ("amx", "avx512_bf16", "avx512", "avx2", "other")


@dataclass(frozen=True)
class CpuCaps:
    """What this machine reports: ATen's vector ISA (its kernels are compiled per ISA and
    dispatched at run time, ATEN_CPU_CAPABILITY lowers it), the CPU's flags, and oneDNN."""

    aten_isa: str  # "AVX512", "AVX2", "DEFAULT", ... (torch.backends.cpu.get_cpu_capability)
    avx512_bf16: bool
    amx_bf16: bool
    onednn_bf16: bool  # oneDNN packs bfloat16 weights (natively, or emulated on AVX-512)


@dataclass(frozen=True)
class CpuPlan:
    """The kernels a CPU engine serves a GGUF model with when no flag says otherwise."""

    family: str  # one of FAMILIES
    dtype: torch.dtype  # activations, KV cache and dense weights
    int4_rows: int  # batches of at most this many rows run 4-bit codes on the int4 kernel
    int4_wide_rows: int  # the same for 5- to 8-bit codes (two planes); 0: always dense
    threads: int | None = None  # torch's threads when --threads is not given (None: torch's)
    # batches of at most this many rows run 5- to 8-bit codes and a GGUF model's LM head on the
    # integer dot-product kernel (ops/cpu_intdot.py); 0: never
    intdot_rows: int = 0
    # the kernel of 4-bit codes up to int4_rows: "int4" (torch's) or "intdot" (the integer dot
    # kernel, where torch's runs a slow path)
    int4_kernel: str = "int4"
    # times the integer dot kernel rounds the activations to int8 (ops/cpu_intdot.py): 2 (below
    # bfloat16's error) or 1 (llama.cpp's rounding, half the multiplications)
    intdot_rounds: int = 2
    # batches of at most this many rows of bfloat16 activations run bfloat16 weights (unquantized
    # ones, 16-bit GGUF ones) on skyline's bf16 kernel (ops/cpu_bf16.py) where a plain copy
    # beside oneDNN's packed one fits in memory; 0: never
    bf16_rows: int = 0

    @property
    def gguf_packed(self) -> bool:
        """Whether a GGUF model keeps its blocks (for the int4 or integer dot kernel) by
        default."""
        return self.int4_rows > 0 or self.intdot_rows > 0


def _flag(caps: dict[str, bool], name: str, probe: str) -> bool:
    # torch.cpu.get_capabilities() (recent torch) lists every flag; older builds have probes
    if name in caps:
        return bool(caps[name])
    fn = getattr(torch.cpu, probe, None)
    return bool(fn()) if fn is not None else False


@functools.lru_cache(maxsize=1)
def probe() -> CpuCaps:
    """This machine's capabilities (read once)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    caps = get() if get is not None else {}
    return CpuCaps(
        aten_isa=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=_flag(caps, "avx512_bf16", "_is_avx512_bf16_supported"),
        amx_bf16=_flag(caps, "amx_bf16", "_is_amx_tile_supported"),
        onednn_bf16=cpu_linear.can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)),
    )


def family(caps: CpuCaps) -> str:
    """The family whose kernels run fastest here; ATen's ISA bounds what its kernels use."""
    if caps.aten_isa == "AVX512":
        if caps.onednn_bf16 and caps.amx_bf16:
            return "amx"
        if caps.onednn_bf16 and caps.avx512_bf16:
            return "avx512_bf16"
        return "avx512"
    if caps.aten_isa == "AVX2":
        return "avx2"
    return "other"


# Rows up to which the int4 kernel beats a dense product on the default model's Linears (30
# layers of 576-wide projections, weights streamed from memory), measured per family at 1 and
# 2 threads (bench/cpu_kernel_plan.py; AVX2's by bench/cpu_intdot_speed.py on an AMD EPYC: at 8
# rows torch's int4 kernel 22.4 ms, the integer dot kernel rounding twice 19.7, dense float32
# 28.5). "other" (no x86 vector ISA torch dispatches to, e.g. ARM) keeps the dense float32
# path, whose speed there is known.
_PLANS = {
    "amx": (torch.bfloat16, 8, 0),
    "avx512_bf16": (torch.bfloat16, 8, 0),
    "avx512": (torch.float32, 8, 4),
    "avx2": (torch.float32, 8, 0),
    "other": (torch.float32, 0, 0),
}
# Rows up to which the integer dot-product kernel runs (where it builds), on every x86 family:
# measured on AVX-512 VNNI and AVX2 (bench/cpu_intdot_speed.py).
INTDOT_ROWS = 2
# Families whose 4-bit codes take the integer dot kernel rather than torch's int4 kernel and
# whose activations it rounds once unless told twice (AVX2: the module docstring).
ROUND_ONCE = {"avx2"}
# Rows up to which the integer dot kernel runs 4-bit / 5- to 8-bit codes with activations
# rounded once (bench/cpu_intdot_speed.py at 2 threads). AVX2 without VNNI on an AMD EPYC: the
# module docstring. AVX-512 BF16 on an AMD EPYC, where one rounding is asked for
# (SKYLINE_CPU_INTDOT_ROUNDS=1, a tuned plan's intdot_rounds): 4-bit codes at 1 / 2 / 4 / 8 / 16
# rows 3.14 / 4.09 / 5.77 / 9.27 / 16.67 ms against torch's int4 kernel's 4.10 / 4.92 / 6.54 /
# 11.63 / 21.82 and dense bf16's 11.23 / 11.78 / 10.58 / 12.83 / 16.17; 8-bit codes 4.68 /
# 5.35 / 7.36 / 10.63 / 17.88 ms.
ONCE_ROWS = {"avx2": (32, 16), "avx512_bf16": (8, 8)}
# Rows up to which the bf16 kernel runs bfloat16 weights with bfloat16 activations: a family's
# own (AVX-512 BF16, AMX), or those of a model served in bfloat16 on a family that computes in
# float32 (--dtype bfloat16, a GPU + CPU placement's CPU stage). bench/cpu_bf16_speed.py at 2
# threads on an AVX-512 BF16 AMD EPYC, weights in huge pages as the engine holds them, against
# oneDNN's packed products at 1 / 2 / 4 / 8 rows: 1.58x / 1.31x / 0.99x / 0.68x on a
# Llama-3.1-8B layer's shapes, 2.21x / 1.95x / 1.37x / 1.05x on the default model's. AVX-512
# without BF16 (emulated there: the kernel built for skylake-avx512, oneDNN capped at
# AVX512_CORE, whose bfloat16 it emulates): 1.00x / 3.09x / 3.48x / 2.92x on the 8B layer.
# AVX2 (an AMD EPYC without AVX-512; oneDNN packs no bfloat16 there, so the plain weight is all
# a layer holds, and batches beyond these rows take cpu_bf16.dense_linear's float32 GEMMs over
# slabs of it), the 8B layer at 1 / 4 / 16 / 32 / 64 rows: 30.6 / 58.3 / 189 / 326 / 787 ms,
# the slabs' GEMMs 96.8 / 198 / 285 / 402 / 802, ATen's bfloat16 F.linear 46.8 / 165 / 758 /
# 1,342 / 2,555 (the default model's shapes: the kernel first up to 32 rows as well).
BF16_ROWS = {"amx": 4, "avx512_bf16": 4, "avx512": 8, "avx2": 32}

KERNEL = "cpu_plan"  # the plan's entry in the kernel tables, keyed by family
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def plan_for(caps: CpuCaps) -> CpuPlan:
    fam = family(caps)
    dtype, rows, wide = _PLANS[fam]
    tuned = tuning.get_config(KERNEL, fam, {}, device=tuning.cpu_device_name())
    built = cpu_intdot.available()
    rounds = _rounds(tuned, 1 if fam in ROUND_ONCE and built else 2)
    once = built and rounds == 1 and fam in ONCE_ROWS  # the rows where one rounding wins
    kernel = "intdot" if built and (fam in ROUND_ONCE or once) else "int4"
    intdot = INTDOT_ROWS if fam != "other" and built else 0
    if once:
        rows, intdot = ONCE_ROWS[fam]
    threads = None
    bf16 = BF16_ROWS.get(fam, 0)
    if tuned:
        dtype, rows, wide, intdot, threads = _tuned(tuned, dtype, rows, wide, intdot)
        bf16 = _count(tuned, "bf16_rows", bf16) or 0
    if envs.ENV.cpu_bf16_rows:
        bf16 = max(0, envs.ENV.cpu_bf16_rows)
    if not built:
        intdot = 0
    if not built:
        bf16 = 0
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        wide = 0
        rows = rows if kernel == "intdot" else 0
    return CpuPlan(fam, dtype, rows, wide, threads, intdot, kernel, rounds, bf16)


def _rounds(tuned: dict, default: int) -> int:
    # SKYLINE_CPU_INTDOT_ROUNDS over a stored plan's intdot_rounds over the family's
    if envs.ENV.cpu_intdot_rounds:
        if envs.ENV.cpu_intdot_rounds not in (1, 2):
            raise ValueError(f"SKYLINE_CPU_INTDOT_ROUNDS={envs.ENV.cpu_intdot_rounds} must be "
                             "1 or 2 (0: the CPU plan's choice)")
        return envs.ENV.cpu_intdot_rounds
    rounds = tuned.get("intdot_rounds", default) if tuned else default
    if rounds not in (1, 2) or isinstance(rounds, bool):
        raise tuning.KernelConfigError(
            f"the tuned CPU plan's intdot_rounds is {rounds!r}, not 1 or 2; delete "
            f"{tuning.user_config_path(tuning.cpu_device_name())} or run `skyline tune` again")
    return rounds


def _tuned(tuned: dict, dtype: torch.dtype, rows: int, wide: int, intdot: int
           ) -> tuple[torch.dtype, int, int, int, int | None]:
    # a stored plan (skyline tune) over the family's defaults, checked
    name = tuned.get("dtype")
    if name is not None and name not in DTYPES:
        raise tuning.KernelConfigError(
            f"the tuned CPU plan's dtype is {name!r}, not one of {', '.join(DTYPES)}; delete "
            f"{tuning.user_config_path(tuning.cpu_device_name())} or run `skyline tune` again")
    return (DTYPES[name] if name else dtype, _count(tuned, "int4_rows", rows) or 0,
            _count(tuned, "int4_wide_rows", wide) or 0,
            _count(tuned, "intdot_rows", intdot) or 0, _count(tuned, "threads", None) or None)


def _count(tuned: dict, name: str, default: int | None) -> int | None:
    v = tuned.get(name, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise tuning.KernelConfigError(
            f"the tuned CPU plan's {name} is {v!r}, not a whole number >= 0; delete "
            f"{tuning.user_config_path(tuning.cpu_device_name())} or run `skyline tune` again")
    return v


def plan() -> CpuPlan:
    """This machine's plan."""
    return plan_for(probe())
