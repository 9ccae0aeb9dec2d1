"""Integer codes as other tools pack them, and skyline's INT4/INT8 layout (ops/int_matmul.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skyline.config import ConfigError
from skyline.quant.base import pack_nibbles, pad_cols


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 words -> uint8 codes, unpacked along `dim`: word j holds elements (32 / bits) * j
    + order[i] in bits [bits * i, bits * (i + 1)) (order: the identity, GPTQ's and
    compressed-tensors' packing; AWQ's interleaves)."""
    per = 32 // bits
    words = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    fields = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)  # [..., words, per]
    if order is not None:  # field i holds element order[i]: element e is field position[e]
        fields = fields[..., torch.argsort(torch.tensor(order))]
    return fields.flatten(-2).movedim(-1, dim).to(torch.uint8)


def skyline_codes(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Unsigned codes [N, K] (K at least the layer's input size, extra columns padding) as
    skyline's qweight: padded to whole groups, two codes a byte for 4 bits."""
    codes = pad_cols(codes, group)
    return pack_nibbles(codes) if bits == 4 else codes.contiguous()


def trivial_g_idx(g_idx: torch.Tensor, group: int, what: str) -> None:
    """Raise unless g_idx [K] puts column k in group k // group (0: one group): what a checkpoint
    quantized without activation order stores."""
    cols = torch.arange(g_idx.numel(), device=g_idx.device)
    want = cols // group if group else torch.zeros_like(cols)
    if not torch.equal(g_idx.long(), want):
        raise ConfigError(f"{what} says its columns are in order, but its g_idx reorders them; "
                          "the checkpoint is inconsistent, download it again")


def symmetric_zeros(rows: int, cols: int, bits: int, group: int) -> torch.Tensor:
    """Zero points 2^(bits - 1) [rows, cdiv(cols, group)]: codes stored offset by half their
    range, as symmetric quantizers store them."""
    return torch.full((rows, -(-cols // group)), 2 ** (bits - 1), dtype=torch.uint8)
