"""What a written checkpoint's bytes are made of (`skyline quantize` prints it): embeddings, LM
head, Linears, norms, read from the safetensors header, against the source's size, and why the
output can be larger than a GGUF source (embeddings stay unquantized)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "U8": "uint8",
           "I8": "int8", "F8_E4M3": "float8_e4m3fn", "I32": "int32"}


def _part(name: str) -> str:
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "LM head"
    if "norm" in name:
        return "norms"
    if "_proj" in name or ".mlp." in name or ".self_attn." in name:
        return "Linears"
    return "other"


def checkpoint_parts(path: str) -> dict[str, dict[str, object]]:
    """Part -> {"bytes", "dtypes"} for every tensor of the *.safetensors files of `path`."""
    parts: dict[str, dict[str, object]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            p = parts.setdefault(_part(name), {"bytes": 0, "dtypes": set()})
            p["bytes"] += t["data_offsets"][1] - t["data_offsets"][0]  # type: ignore[operator]
            p["dtypes"].add(_DTYPES.get(t["dtype"], t["dtype"]))  # type: ignore[union-attr]
    return parts


def source_bytes(path: str) -> int:
    """A .gguf file's size, or a directory's weight files'."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.gguf")
               for f in p.glob(pattern))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def size_report(out_dir: str, source: str, fmt: str) -> str:
    """Lines for the terminal: each part's size and dtypes, the total against the source, and
    why the output is larger where it is."""
    parts = checkpoint_parts(out_dir)
    total = sum(int(p["bytes"]) for p in parts.values())  # type: ignore[call-overload]
    src = source_bytes(source)
    lines = [f"{out_dir}: {_mb(total)} (source {Path(source).name}: {_mb(src)})"]
    for name in ("embeddings", "LM head", "Linears", "norms", "other"):
        if name in parts:
            p = parts[name]
            what = ", ".join(sorted(p["dtypes"]))  # type: ignore[call-overload]
            if name == "Linears":
                what = f"{fmt}, stored as {what}"
            elif name == "embeddings" and "LM head" not in parts:
                what += "; tied, so also the LM head"
            lines.append(f"  {name:<11} {_mb(int(p['bytes'])):>10}  "  # type: ignore[call-overload]
                         f"({what})")
    emb = parts.get("embeddings")
    if total > src and emb is not None and "float32" in emb["dtypes"]:  # type: ignore[operator]
        lines.append(
            f"  larger than the source: only the Linears are quantized; the embeddings stay in "
            f"float32 ({_mb(int(emb['bytes']))}), where the source stores them in fewer bits "  # type: ignore[call-overload]
            "(served in bfloat16, the default for these formats on a CPU, they take half that "
            "in memory)")
    return "\n".join(lines)
