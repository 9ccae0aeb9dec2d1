"""GGUF (ggml) tensor dequantization: vectorized PyTorch references, on any device.

Input is a tensor as a GGUF file stores it: `[..., bytes_per_row]` uint8 (what
`gguf.GGUFReader` gives as `tensor.data` for block types), or the float32/float16 array the
reader gives for F32/F16. Output is float32 `[..., cols]`. Each block type is decoded with the
same float32 operations, in the same order, as `gguf.quants`, so results match it bit for bit.

Triton dequant-matmul kernels live beside these and are tested against them.
"""

from __future__ import annotations

import torch

# ggml type id -> (name, elements per block, bytes per block). Ids are fixed by the GGUF format.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
SUPPORTED_TYPE_NAMES: tuple[str, ...] = tuple(name for name, _, _ in GGML_TYPES.values())
QK_K = 256


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    # [n_blocks, type_size] uint8 -> [n_blocks, 1] float32 from the fp16 at byte `start`
    return b[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifts(values: list[int], device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, k * group] bytes -> [n, k, 2, group]: low nibbles of each group, then high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts([0, 4], qs.device, (1, 1, 2, 1))
    return q & 0x0F


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 8, m]: bit j of every byte in row j (ggml's high-bit layout)."""
    n = qh.shape[0]
    q = qh.reshape(n, 1, -1) >> _shifts(list(range(8)), qh.device, (1, 8, 1))
    return q & 0x01


# Each block type decoded to unsigned integer codes q [n, groups, group] with a float32 scale
# and offset per group [n, groups], and, for types stored as scale * (q - center), the center.
_Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]


def _centered(q: torch.Tensor, d: torch.Tensor, center: int) -> _Parts:
    return q, d, -center * d, center


def _q4_0(b: torch.Tensor) -> _Parts:
    return _centered(_nibbles(b[:, 2:], 16).reshape(-1, 1, 32), _f16(b, 0), 8)


def _q4_1(b: torch.Tensor) -> _Parts:
    return _nibbles(b[:, 4:], 16).reshape(-1, 1, 32), _f16(b, 0), _f16(b, 2), None


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    # 5-bit quants: 4 low bits in nibbles, the 5th bit of element j is bit j of a uint32
    n = b.shape[0]
    qh = _bits(b[:, qh_at : qh_at + 4]).transpose(1, 2).reshape(n, 32)  # element j = byte j//8
    ql = _nibbles(b[:, qh_at + 4 :], 16).reshape(n, 32)
    return (ql | (qh << 4)).reshape(n, 1, 32)


def _q5_0(b: torch.Tensor) -> _Parts:
    return _centered(_q5(b, 2), _f16(b, 0), 16)


def _q5_1(b: torch.Tensor) -> _Parts:
    return _q5(b, 4), _f16(b, 0), _f16(b, 2), None


def _q8_0(b: torch.Tensor) -> _Parts:
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128  # signed -> unsigned
    return _centered(x.to(torch.uint8).reshape(-1, 1, 32), _f16(b, 0), 128)


# The K types' scales per super-block of 256: integer sub-scales and sub-offsets per group
# [n, groups] with one float32 factor each [n, 1], scale = d * sc and offset = dm * mn per group,
# every product exact in float32 (11-bit factors times at most 8-bit integers).
_KScales = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _q2_k_scales(b: torch.Tensor) -> _KScales:
    scales = b[:, :16]
    return scales & 0x0F, _f16(b, 80), scales >> 4, -_f16(b, 82)


def _q2_k(b: torch.Tensor) -> _Parts:
    n = b.shape[0]
    sc, d, mn, dm = _q2_k_scales(b)
    q = b[:, 16:80].reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], b.device, (1, 1, 4, 1))
    return (q & 0x03).reshape(n, 16, 16), d * sc.float(), dm * mn.float(), None


def _q3_k_scales(b: torch.Tensor) -> _KScales:
    n = b.shape[0]
    scales = b[:, 96:108]
    # 16 six-bit scales: low 4 bits from bytes 0..7 (two nibbles), high 2 bits from bytes 8..11
    lsc = (scales[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], b.device, (1, 2, 1))).reshape(n, 16)
    hsc = scales[:, 8:].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], b.device, (1, 4, 1))
    sc = ((lsc & 0x0F) | ((hsc.reshape(n, 16) & 0x03) << 4)).to(torch.int16) - 32
    d = _f16(b, 108)
    return sc, d, sc, -4 * d


def _q3_k(b: torch.Tensor) -> _Parts:
    n = b.shape[0]
    hmask, qs = b[:, :32], b[:, 32:96]
    sc, d, _, _ = _q3_k_scales(b)
    ql = qs.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], b.device, (1, 1, 4, 1))
    qh = hmask.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), b.device, (1, 1, 8, 1))
    # a set high bit means no -4 offset: q - 4 with q = ql + 4 * hbit in 0..7
    q = (ql.reshape(n, 16, 16) & 0x03) | ((qh.reshape(n, 16, 16) & 0x01) << 2)
    return _centered(q, d * sc.float(), 4)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] packed 6-bit scales and mins of Q4_K/Q5_K -> ([n, 8], [n, 8])."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k4_parts(b: torch.Tensor) -> _KScales:
    # Q4_K / Q5_K: d * sc and -dmin * mn per 32 elements
    sc, mn = _scale_min_k4(b[:, 4:16])
    return sc, _f16(b, 0), mn, -_f16(b, 2)


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, d, mn, dm = _k4_parts(b)
    return d * sc.float(), dm * mn.float()


def _q4_k(b: torch.Tensor) -> _Parts:
    return _nibbles(b[:, 16:], 32).reshape(-1, 8, 32), *_k4_scales(b), None


def _q5_k(b: torch.Tensor) -> _Parts:
    q = _nibbles(b[:, 48:], 32).reshape(-1, 8, 32) | (_bits(b[:, 16:48]) << 4)
    return q, *_k4_scales(b), None


def _q6_k_scales(b: torch.Tensor) -> _KScales:
    sc = b[:, 192:208].contiguous().view(torch.int8)
    d = _f16(b, 208)
    return sc, d, sc, -32 * d


def _q6_k(b: torch.Tensor) -> _Parts:
    n = b.shape[0]
    sc, d, _, _ = _q6_k_scales(b)
    ql = _nibbles(b[:, :128], 64).reshape(n, -1, 32)  # [n, 8, 32]
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], b.device, (1, 1, 4, 1))
    q = ql | ((qh & 0x03).reshape(n, -1, 32) << 4)
    return _centered(q.reshape(n, 16, 16), d * sc.float(), 32)


_K_SCALES = {10: _q2_k_scales, 11: _q3_k_scales, 12: _k4_parts, 13: _k4_parts, 14: _q6_k_scales}
SUPER_GROUP_TYPES = tuple(_K_SCALES)  # the types super_groups takes: Q2_K .. Q6_K
_BLOCK_FNS = {
    2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0,
    10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k, 14: _q6_k,
}


def _values(parts: _Parts) -> torch.Tensor:
    """The float32 weights [n, groups * group], in gguf.quants' arithmetic: scale * (q - center)
    for centred types, q * scale + offset for the others."""
    q, scale, offset, center = parts
    if center is not None:
        w = scale[..., None] * (q.to(torch.int16) - center).float()
    else:
        w = q.float() * scale[..., None] + offset[..., None]
    return w.reshape(q.shape[0], -1)


# Types whose weights are 4-bit codes with an affine map per 32 elements.
INT4_GROUP_TYPES = (2, 3, 12)  # Q4_0, Q4_1, Q4_K
# Block types as integer codes with a scale and an offset per group: elements per group.
AFFINE_GROUP = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 10: 16, 11: 16, 12: 32, 13: 32, 14: 16}


def affine_groups(data: torch.Tensor, qtype: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A block-quantized tensor `[rows, bytes_per_row]` as unsigned integer codes with a
    scale and an offset per group of elements: W = q * scale + offset, `dequantize_ref`'s
    values (exactly, as every product is exact in float32, but for Q6_K whose d * sc * q can
    need 25 bits). Returns codes `[rows, cols]` uint8, scale and offset `[rows, cols / group]`
    float32, and the group: 32 for Q4_0 (d, -8d), Q4_1 (d, m), Q5_0 (d, -16d), Q5_1 (d, m),
    Q8_0 (codes q + 128: d, -128d), Q4_K / Q5_K (d * sc, -dmin * mn); 16 for Q6_K (d * sc,
    -32 d * sc), Q2_K (d * sc, -dmin * mn) and Q3_K (codes ql + 4 * hbit: d * sc, -4 d * sc)."""
    qtype = int(qtype)
    if qtype not in AFFINE_GROUP:
        raise ValueError(f"{type_name(qtype)} is not a block type of integer codes")
    rows = data.shape[0]
    q, scale, offset, _ = _BLOCK_FNS[qtype](data.contiguous().reshape(-1, GGML_TYPES[qtype][2]))
    return (q.reshape(rows, -1).to(torch.uint8), scale.reshape(rows, -1).float(),
            offset.reshape(rows, -1).float(), AFFINE_GROUP[qtype])


def super_groups(data: torch.Tensor, qtype: int) -> tuple[torch.Tensor, ...] | None:
    """A K-type tensor (Q2_K..Q6_K) `[rows, bytes_per_row]` as affine_groups' codes with each
    group's scale and offset kept as the file holds them, an integer per group times a float per
    256 elements: (codes [rows, cols] uint8, sub-scales [rows, cols / group] int16, scale factors
    [rows, cols / 256] float32, sub-offsets, offset factors, group), scale = factor * sub per
    group exactly; None for other types."""
    qtype = int(qtype)
    if qtype not in _K_SCALES:
        return None
    rows = data.shape[0]
    codes, _, _, group = affine_groups(data, qtype)
    sc, d, mn, dm = _K_SCALES[qtype](data.contiguous().reshape(-1, GGML_TYPES[qtype][2]))
    return (codes, sc.to(torch.int16).reshape(rows, -1), d.reshape(rows, -1),
            mn.to(torch.int16).reshape(rows, -1), dm.reshape(rows, -1), group)


def int4_groups(data: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor as 4-bit codes with a scale and an offset per 32 elements
    (affine_groups for the 4-bit group types): codes `[rows, cols]` uint8 (0..15) and scale,
    offset `[rows, cols / 32]` float32."""
    if int(qtype) not in INT4_GROUP_TYPES:
        raise ValueError(f"{type_name(qtype)} is not a 4-bit group type")
    return affine_groups(data, qtype)[:3]


def type_name(qtype: int) -> str:
    entry = GGML_TYPES.get(int(qtype))
    return entry[0] if entry else f"ggml type {int(qtype)}"


def dequantize_ref(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32.

    data: `[..., bytes_per_row]` uint8 as stored (or the reader's float32/float16 array for
    F32/F16); qtype: ggml type id (`gguf.GGMLQuantizationType` works). Returns a new float32
    tensor `[..., cols]` on data's device.
    """
    qtype = int(qtype)
    if qtype not in GGML_TYPES:
        raise ValueError(
            f"cannot dequantize {type_name(qtype)}; supported: {', '.join(SUPPORTED_TYPE_NAMES)}"
        )
    _, block_size, type_size = GGML_TYPES[qtype]
    if data.dtype != torch.uint8:
        data = data.contiguous().view(torch.uint8)  # reinterpret the row's bytes
    if data.dim() == 0 or data.shape[-1] % type_size:
        raise ValueError(f"row of {tuple(data.shape)} bytes is not whole {type_name(qtype)} blocks")
    lead = data.shape[:-1]
    cols = data.shape[-1] // type_size * block_size
    data = data.contiguous()
    if qtype == 0:
        return data.view(torch.float32).clone()
    if qtype == 1:
        return data.view(torch.float16).float()
    if qtype == 30:
        return data.view(torch.bfloat16).float()
    blocks = data.reshape(-1, type_size)  # [n_blocks, type_size]
    return _values(_BLOCK_FNS[qtype](blocks)).reshape(*lead, cols)
