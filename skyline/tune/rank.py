"""Which kernel family loses the most time: profiled device time per family against the family's
floor for the shapes the workload ran (bytes over the copy bandwidth, FLOPs over the matmul
peak, both measured in the same run).

Families are named by the kernels' names (Triton kernels by their function, cuBLAS and oneDNN
products by their library's names, CPU ops by their aten names); a kernel no family claims is
reported under "other" and never tuned. A family owns a tuner when one can change its launch
configurations or the CPU plan's choices; the others are reported only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# family -> (kind of work it does for the floor, its tuner or None, name fragments)
# Order matters: the first family whose fragment a kernel name holds claims it.
FAMILIES: dict[str, tuple[str | None, str | None, tuple[str, ...]]] = {
    # NVFP4 / MXFP4 / GGUF K-quant weights read as stored by the decode GEMV (its tuner's);
    # above 8 rows dequantized into a scratch buffer for a matmul, a family of its own so that
    # a round of the GEMV's tuner is not judged on the prefill it does not change
    "gemv_block": ("matmul", "gemv_block", ("gemv_block_a8_kernel", "gemv_block_kernel",
                                            "quantize_x_q8_kernel")),
    "block_dequant": ("matmul", None, ("dequant_block_kernel",)),
    "gemv": ("matmul", "gemv", ("_gemv_kernel", "split_k_epilogue")),
    "gemv_quant": ("matmul", None, ("gemv_quant_kernel", "gemv_int_fma_kernel",
                                    "gemv_int4_a8_kernel", "quantize_x_words_kernel")),
    "moe": ("matmul", None, ("grouped_matmul_kernel",)),
    # the CPU's decode step in one C++ call (ops/csrc/cpu_decode.cpp): the layers' products on
    # the CPU plan's kernels (most of its time) and the operations between them
    "cpu_decode": ("matmul", "cpu_linear", ("skyline_cpu::decode_layers",)),
    "attention": ("attention", "attention", ("paged_decode_kernel", "combine_splits_kernel",
                                      "paged_prefill_kernel", "paged_prefill_varlen_kernel",
                                      "scaled_dot_product", "skyline_cpu::decode_attention",
                                      "flash_attention", "aten::bmm", "aten::baddbmm",
                                      "aten::_softmax", "aten::_safe_softmax")),
    # cuBLAS / CUTLASS on a GPU; oneDNN, the int4 and the integer dot kernels on a CPU (the
    # CPU plan's choice)
    "linear": ("matmul", "cpu_linear", ("gemm", "nvjet", "cutlass", "xmma", "cublas",
                                        "aten::addmm", "aten::mm", "aten::linear",
                                        "mkldnn", "int4pack", "aten::_int_mm", "sgemm",
                                        "skyline_cpu::intdot_mm")),
    "norm": (None, None, ("_rms_norm_kernel", "rms_norm", "layer_norm")),
    "rotary": (None, None, ("_rotary_kernel", "rotary")),
    "activation": (None, None, ("silu_and_mul", "aten::silu")),
    "kv_write": (None, None, ("_write_kv_kernel",)),
}
OTHER = "other"


def family_of(kernel: str) -> str:
    """The family that owns the kernel called `kernel` ("other" when none does)."""
    for fam, (_, _, fragments) in FAMILIES.items():
        if any(f in kernel for f in fragments):
            return fam
    return OTHER


def kind_of(family: str) -> str | None:
    return FAMILIES[family][0] if family in FAMILIES else None


def tuner_of(family: str, device_type: str) -> str | None:
    """The tuner of `family` on a "cuda" or "cpu" device (None: reported, not tuned)."""
    tuner = FAMILIES[family][1] if family in FAMILIES else None
    if tuner == "cpu_linear":
        return tuner if device_type == "cpu" else None  # cuBLAS has no knobs of ours
    return tuner if device_type == "cuda" else None  # Triton kernels: a GPU's only


def by_family(kernels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """[{"name", "s"}] of one profiled phase -> {family: {"s", "kernels": [names]}}."""
    out: dict[str, dict[str, Any]] = {}
    for k in kernels:
        f = out.setdefault(family_of(k["name"]), {"s": 0.0, "kernels": []})
        f["s"] += k["s"]
        f["kernels"].append(k["name"])
    return out


@dataclass(frozen=True)
class PhaseWork:
    """The work of one phase of the workload, per kind: bytes the device must move and FLOPs it
    must do at least (from the model's cost and the phase's shapes)."""

    matmul_bytes: float
    matmul_flops: float
    attention_bytes: float
    attention_flops: float

    def floor(self, kind: str, peak_flops: float, bandwidth: float) -> float:
        """Seconds: the larger of the bytes over the bandwidth and the FLOPs over the peak."""
        b, f = ((self.matmul_bytes, self.matmul_flops) if kind == "matmul"
                else (self.attention_bytes, self.attention_flops))
        return max(b / bandwidth, f / peak_flops)


def phase_work(cost: Any, prompts: int, new_tokens: int, context: int, steps: int
               ) -> PhaseWork:
    """`steps` steps, each feeding `new_tokens` tokens of each of `prompts` sequences whose
    context before the step is `context` (prefill: one step of the whole prompt, context 0;
    decode: new_tokens 1). Weights are read once a step; the LM head runs once a sequence a
    step; each new token attends to the tokens before it (causally within the step)."""
    rows = prompts * new_tokens
    linear_flops = 2 * cost.linear_params * rows + 2 * cost.head_params * prompts
    pairs = prompts * (new_tokens * context + new_tokens * (new_tokens + 1) / 2)
    # the K/V of the context is read once per sequence; the new tokens' own K/V is written
    kv_bytes = prompts * (context + new_tokens) * cost.kv_bytes_per_token
    return PhaseWork(
        matmul_bytes=steps * cost.step_weight_bytes(rows),
        matmul_flops=steps * linear_flops,
        attention_bytes=steps * kv_bytes,
        attention_flops=steps * cost.attn_flops_per_pair * pairs)


def rank(phases: dict[str, dict[str, Any]], work: dict[str, PhaseWork], peak_flops: float,
         bandwidth: float, device_type: str) -> list[dict[str, Any]]:
    """Families by time lost (time - floor), most first. `phases`: {phase: by_family(...)};
    `work`: {phase: PhaseWork}. In each phase, a kind's floor (matmul or attention) is shared
    among the families of that kind by their time there (their floor fraction is the kind's);
    families of no kind have no floor (all their time is lost)."""
    total = sum(f["s"] for fams in phases.values() for f in fams.values()) or 1.0
    rows: dict[str, dict[str, Any]] = {}
    for phase, fams in phases.items():
        kind_s: dict[str, float] = {}
        for fam, f in fams.items():
            if (kind := kind_of(fam)) is not None:
                kind_s[kind] = kind_s.get(kind, 0.0) + f["s"]
        for fam, f in fams.items():
            r = rows.setdefault(fam, {"family": fam, "s": 0.0, "floor_s": 0.0,
                                      "kernels": set()})
            r["s"] += f["s"]
            r["kernels"].update(f["kernels"])
            kind = kind_of(fam)
            if kind is not None and phase in work and kind_s[kind] > 0:
                kind_floor = work[phase].floor(kind, peak_flops, bandwidth)
                r["floor_s"] += kind_floor * f["s"] / kind_s[kind]
    out = []
    for r in rows.values():
        floor = min(r["floor_s"], r["s"])  # a floor above the time: a cost model's miss
        out.append({**r, "kernels": sorted(r["kernels"])[:8], "floor_s": floor,
                    "share": r["s"] / total, "lost_s": r["s"] - floor,
                    "floor_fraction": floor / r["s"] if r["s"] > 0 else None,
                    "tuner": tuner_of(r["family"], device_type)})
    return sorted(out, key=lambda r: -r["lost_s"])
