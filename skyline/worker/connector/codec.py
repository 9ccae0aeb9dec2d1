"""A block's KV across all of this rank's layers as one row of bytes (its payload), and back.

The device holds KV per layer as [2, num_blocks, block_size, num_kv_heads, head_dim]; a block
is 2 * num_layers strided pieces of it. Below the device a block is one contiguous payload, so
that a RAM slot or a file holds it whole and a transfer is one copy per block:
- "auto": the cache's own bytes, [num_layers, 2, block_size, num_kv_heads, head_dim] (an fp8
  cache's e4m3 bytes with it: its per-layer scales are part of the fingerprint);
- "fp8" / "int8": each (token, head) row quantized with its own float32 scale (amax / 448,
  or amax / 127 rounded to nearest): the codes, then the scales [num_layers, 2, block_size,
  num_kv_heads]. With head_dim 128 that is 0.52x the bytes of a 16-bit cache (0.26x of
  fp32); the error is that of one rounding to e4m3 or int8 per element.
`gather` and `scatter` run on the device in the current stream, on index tensors there.
"""

from __future__ import annotations

import torch

from skyline.ops.kv_quant import FP8_DTYPE, FP8_MAX

CODES = {"fp8": (FP8_DTYPE, FP8_MAX), "int8": (torch.int8, 127.0)}


class BlockCodec:
    def __init__(self, kv_caches: list[torch.Tensor], dtype: str = "auto") -> None:
        self.caches = kv_caches  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.dtype = dtype
        self.cache_dtype = kv_caches[0].dtype
        _, _, bs, heads, dim = kv_caches[0].shape
        self.shape = (len(kv_caches), 2, bs, heads, dim)  # one block
        n = len(kv_caches) * 2 * bs * heads * dim
        if dtype == "auto":
            self.bytes = [c.view(torch.uint8) for c in kv_caches]  # copies move raw bytes
            self.payload_bytes = n * kv_caches[0].element_size()
        else:
            self.code_dtype, self.qmax = CODES[dtype]
            self.num_codes = n
            self.payload_bytes = n + 4 * (n // dim)  # codes, then float32 scales

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[len(block_ids), payload_bytes] uint8: the blocks' payloads."""
        n = len(block_ids)
        if self.dtype == "auto":
            out = torch.empty((n, *self.shape[:-1], self.bytes[0].shape[-1]), dtype=torch.uint8,
                              device=block_ids.device)
            for i, c in enumerate(self.bytes):
                out[:, i] = c.index_select(1, block_ids).transpose(0, 1)
            return out.view(n, -1)
        codes = torch.empty((n, *self.shape), dtype=self.code_dtype, device=block_ids.device)
        scales = torch.empty((n, *self.shape[:-1]), dtype=torch.float32,
                             device=block_ids.device)
        for i, c in enumerate(self.caches):
            x = c.index_select(1, block_ids).transpose(0, 1).float()  # [n, 2, bs, heads, dim]
            s = x.abs().amax(-1, keepdim=True).div_(self.qmax).clamp_(min=1e-30)
            q = x.div_(s)
            if self.code_dtype == torch.int8:
                q = q.round_().clamp_(-self.qmax, self.qmax)
            codes[:, i] = q.to(self.code_dtype)
            scales[:, i] = s.squeeze(-1)
        return torch.cat((codes.view(torch.uint8).view(n, -1),
                          scales.view(torch.uint8).view(n, -1)), dim=1)

    def scatter(self, payload: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Write payloads ([n, payload_bytes] uint8, on the device) into the blocks."""
        n = len(block_ids)
        if self.dtype == "auto":
            rows = payload.view(n, *self.shape[:-1], self.bytes[0].shape[-1])
            for i, c in enumerate(self.bytes):
                c.index_copy_(1, block_ids, rows[:, i].transpose(0, 1))
            return
        codes = payload[:, : self.num_codes].contiguous().view(self.code_dtype)
        codes = codes.view(n, *self.shape)
        scales = payload[:, self.num_codes :].contiguous().view(torch.float32)
        scales = scales.view(n, *self.shape[:-1], 1)
        for i, c in enumerate(self.caches):
            x = (codes[:, i].float() * scales[:, i]).to(self.cache_dtype)
            c.index_copy_(1, block_ids, x.transpose(0, 1))
