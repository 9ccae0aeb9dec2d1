"""Per-layer format assignments: the candidate formats of a mixed-precision search, the size
budget, exact byte counts, and the QuantConfig / assignment.json an assignment becomes.

A format is a method and, for int8/int4, a group size: "int4" (group --group-size),
"int4-g32", "nvfp4", "none" (the model dtype). Sizes count every tensor a Linear stores in
memory (codes, scales, zero points, per-tensor scales, bias); embeddings, norms and the LM
head are never quantized and are not part of the budget.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skyline.config import ConfigError, QuantConfig, parse_size
from skyline.quant.method import LinearLayer

SEARCHABLE = ("none", "fp8", "int8", "int4", "mxfp4", "nvfp4")
_FORMAT = re.compile(r"^([a-z0-9]+?)(?:-g(\d+))?$")


@dataclass(frozen=True, order=True)
class Format:
    method: str
    group_size: int = 128  # meaningful for int8/int4 only; 128 for the others

    @property
    def name(self) -> str:
        grouped = self.method in ("int8", "int4") and self.group_size != 128
        return f"{self.method}-g{self.group_size}" if grouped else self.method

    def quant_config(self) -> QuantConfig:
        return QuantConfig(method=self.method, group_size=self.group_size)


def parse_format(text: str, group_size: int = 128) -> Format:
    """'int4' -> Format('int4', group_size); 'int4-g32' -> Format('int4', 32); 'nvfp4' ..."""
    m = _FORMAT.match(text.strip().lower())
    if not m or m.group(1) not in SEARCHABLE or (m.group(2) and m.group(1) not in ("int4",
                                                                                  "int8")):
        raise ConfigError(f"cannot read format {text!r}; use one of {', '.join(SEARCHABLE)}, "
                          "int4/int8 optionally with a group size such as int4-g32")
    if m.group(1) not in ("int4", "int8"):
        return Format(m.group(1))
    group = int(m.group(2)) if m.group(2) else group_size
    QuantConfig(method=m.group(1), group_size=group)  # validates the group size
    return Format(m.group(1), group)


def parse_formats(text: str, group_size: int = 128) -> list[Format]:
    """A comma-separated list of formats, duplicates removed, in the given order."""
    formats = list(dict.fromkeys(parse_format(t, group_size) for t in text.split(",")
                                 if t.strip()))
    if not formats:
        raise ConfigError("--formats is empty; pass e.g. int4,int4-g32,int8")
    return formats


def parse_budget(
    text: str, num_weights: int, layers: dict[str, LinearLayer] | None = None,
    group_size: int = 128,
) -> int:
    """'4.5' (bits per Linear weight), '70MiB' (bytes) or, given the model's `layers`, a
    format name such as 'int4-g32' (that format's uniform size) -> a byte budget."""
    text = text.strip()
    bits = text.lower().removesuffix("bpw")
    if layers is not None and _FORMAT.match(bits) and not bits[:1].isdigit():
        try:
            fmt = parse_format(text, group_size)
        except ConfigError:
            raise ConfigError(f"cannot read --budget {text!r}; pass bits per weight (e.g. 4.5), "
                              "a size (e.g. 70MiB) or a format (e.g. int4-g32)") from None
        return sum(linear_bytes(m, fmt, m.weight.dtype) for m in layers.values())
    try:
        bpw = float(bits)
    except ValueError:
        return parse_size(text)  # raises the one-sentence error
    if not 0 < bpw <= 32:
        raise ConfigError(f"--budget {text} bits per weight is out of range; pass bits per "
                          "weight (e.g. 4.5), a size with a unit (e.g. 70MiB) or a format")
    return int(bpw * num_weights / 8)


def linear_bytes(layer: LinearLayer, fmt: Format, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the Linear stores in format `fmt` (unquantized weights in `dtype`)."""
    if fmt.method == "none":
        size = layer.out_features * layer.in_features * dtype.itemsize
    else:
        from skyline.quant import make_linear_method

        method = make_linear_method(fmt.quant_config())
        specs = method.param_specs(layer.out_features, layer.in_features)  # type: ignore
        size = sum(_numel(shape) * dt.itemsize for shape, dt in specs.values())
    if layer.bias is not None:
        size += layer.bias.numel() * layer.bias.element_size()
    return size


def check_budget(layers: dict[str, LinearLayer], formats: list[Format], budget: int) -> None:
    """Raise unless the Linears fit in `budget` bytes, each in its smallest format."""
    num_weights = sum(m.in_features * m.out_features for m in layers.values())
    least = sum(min(linear_bytes(m, f, m.weight.dtype) for f in formats)
                for m in layers.values())
    if budget < least:
        raise ConfigError(
            f"a budget of {budget:,} bytes ({8 * budget / num_weights:.3f} bits per weight) is "
            f"below the smallest assignment of these formats, {least:,} bytes "
            f"({8 * least / num_weights:.3f} bits per weight); raise --budget or add a "
            "smaller format")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def stored_bytes(layer: LinearLayer) -> int:
    """Bytes the Linear holds now (its parameters and buffers): what linear_bytes predicts."""
    tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors)


def to_quant_config(assignment: dict[str, Format]) -> QuantConfig:
    """A QuantConfig naming every Linear's format; the most common one is the default."""
    if not assignment:
        raise ConfigError("the assignment is empty; the model has no Linear layers")
    default = Counter(assignment.values()).most_common(1)[0][0]
    layers = tuple((name, f.method, f.group_size) for name, f in assignment.items()
                   if f != default)
    return QuantConfig(method=default.method, group_size=default.group_size, layers=layers)


def assignment_json(assignment: dict[str, Format], **extra: Any) -> dict[str, Any]:
    return {**extra, "layers": {name: f.name for name, f in assignment.items()}}


def read_assignment(path: str, group_size: int = 128) -> dict[str, Format]:
    """An assignment.json written by `skyline quantize --search` (its "layers" mapping)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        layers = data["layers"]
        if not isinstance(layers, dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read {path} as an assignment ({e}); pass the "
                          "assignment.json that skyline quantize --search wrote") from None
    return {name: parse_format(str(f), group_size) for name, f in layers.items()}
