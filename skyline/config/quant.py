"""Quantization settings: the formats, and which one each Linear runs in."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from skyline.config.arch import ConfigError

QUANT_METHODS = ("none", "fp8", "int8", "int4", "mxfp4", "nvfp4", "gguf")
# The formats `skyline quantize` writes checkpoints of (quant/checkpoint.py), and the
# candidates its format search (`--search`) chooses from by default (quant/assignment.py).
SAVABLE_METHODS = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
DEFAULT_SEARCH_FORMATS = "mxfp4,nvfp4,int4,int4-g64,int4-g32,fp8,int8"
EXPERT_FORMATS = ("none", "fp8", "mxfp4")  # the formats MoE experts run in (ops/moe.py)
# Pre-quantized checkpoints of other tools that load onto skyline's formats (quant/external/).
CHECKPOINT_LAYOUTS = ("gptq", "awq", "compressed-tensors", "modelopt", "mxfp4")


@dataclass(frozen=True)
class CheckpointLayout:
    """How a pre-quantized checkpoint made by another tool stores its tensors; quant/external/
    repacks them into skyline's layout of QuantConfig.method while they load."""

    name: str  # one of CHECKPOINT_LAYOUTS
    bits: int = 4  # int formats: bits a code
    group_size: int = 0  # int formats: the checkpoint's group (0: one per output channel)
    symmetric: bool = True  # int formats without stored zero points: zero 2^(bits - 1)
    zero_offset: int = 0  # GPTQ's v1 format stores every zero point minus 1
    act_order: bool = False  # int formats: g_idx tensors put input columns in their groups
    weight_block: tuple[int, int] | None = None  # fp8: (rows, columns) of one weight scale
    static_input: bool = False  # fp8: activations quantized with a stored per-tensor scale
    # Checkpoint module names (e.g. "model.layers.0.mlp.down_proj") stored unquantized.
    full_precision: frozenset[str] = frozenset()


@dataclass(frozen=True)
class QuantConfig:
    """How Linear weights are stored and multiplied (skyline/quant/); embeddings and the LM
    head stay in the model dtype unless `lm_head` puts the head in fp8 (W8A8).
    `prequantized`: the checkpoint already holds the quantized tensors (written by `skyline
    quantize`); otherwise weights are quantized while loading.

    `layers` gives some Linears their own format (mixed precision): (pattern, method,
    group_size) triples, the first whose fnmatch pattern matches the Linear's module name
    (e.g. "model.layers.3.mlp.down_proj") wins; the others use `method` / `group_size`."""

    method: str = "none"  # one of QUANT_METHODS
    group_size: int = 128  # int8/int4: input elements per scale and zero point
    prequantized: bool = False
    layers: tuple[tuple[str, str, int], ...] = ()
    lm_head: bool = False  # --quantize-lm-head: the LM head in fp8 (W8A8), whatever `method`
    # MoE experts' own format where the checkpoint ships them in one (gpt-oss: "mxfp4",
    # prequantized, the rest of the model unquantized); "": each expert layer's format in
    # `method` / `layers`.
    experts: str = ""
    experts_prequantized: bool = False
    # A checkpoint of another tool (prequantized): how its tensors map onto `method`'s.
    layout: CheckpointLayout | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ConfigError(
                f"--quantization must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}"
            )
        if self.group_size not in (16, 32, 64, 128, 256, 512, 1024):
            raise ConfigError(
                f"--quant-group-size must be a power of two from 16 to 1024, got {self.group_size}"
            )
        for pattern, method, group_size in self.layers:
            if method == "gguf" or self.method == "gguf":
                raise ConfigError("GGUF blocks kept packed cannot be mixed with per-layer formats")
            QuantConfig(method=method, group_size=group_size)  # raises the one-sentence error
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"a per-layer format needs a layer name, got {pattern!r}")
        if self.experts not in ("", *EXPERT_FORMATS):
            raise ConfigError(f"MoE experts can be stored as {', '.join(EXPERT_FORMATS)}, not "
                              f"{self.experts!r}")

    def for_layer(self, name: str) -> QuantConfig:
        """The single-format config of the Linear named `name`."""
        for pattern, method, group_size in self.layers:
            if fnmatch.fnmatchcase(name, pattern):
                return QuantConfig(method, group_size, self.prequantized, layout=self.layout)
        return QuantConfig(self.method, self.group_size, self.prequantized, layout=self.layout)

    def expert_format(self, name: str) -> tuple[str, bool]:
        """(format, prequantized) of the MoE expert layer named `name` (GGUF experts keep
        the file's blocks: quant/gguf_experts.py)."""
        if self.experts:
            return self.experts, self.experts_prequantized
        method = self.for_layer(name).method
        return ("gguf", True) if method == "gguf" else (method, self.prequantized)
