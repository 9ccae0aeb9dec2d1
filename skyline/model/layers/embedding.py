"""Token embedding and the LM head (optionally tied to the embedding).

With tensor parallelism both are vocabulary-parallel: each rank holds an equal slice of the
vocabulary's rows (the last one padded with zero rows); the embedding looks up the tokens in
its slice and the slices' lookups are summed, the head computes its slice's logits and the
sampling rank gathers them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.ops import cpu_bf16, cpu_intdot, cpu_linear
from skyline.ops.fp8_linear import fp8_linear
from skyline.ops.fp8_quant import fake_quantize_rows_fp8, quantize_rows_fp8
from skyline.parallel.groups import Group, ParallelLayout
from skyline.parallel.shard import padded_shard


class VocabShard:
    """The vocabulary rows [start, start + size) of one rank, held in `padded` rows."""

    def __init__(self, vocab_size: int, tp: Group) -> None:
        self.start, self.size, self.padded = padded_shard(vocab_size, tp.size, tp.index)
        self.tp = tp

    def loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of checkpoint tensor `loaded` [vocab, hidden]; zero the
        padding."""
        if loaded.dim() != 2 or loaded.shape[1] != param.shape[1] or \
                loaded.shape[0] < self.start + self.size:
            raise ConfigError(f"shape {tuple(loaded.shape)} does not match the model's "
                              "vocabulary; does config.json belong to this checkpoint?")
        param.data[: self.size].copy_(loaded[self.start : self.start + self.size])
        param.data[self.size :].zero_()

    def weight(self, hidden_size: int) -> nn.Parameter:
        w = nn.Parameter(torch.empty(self.padded, hidden_size), requires_grad=False)
        w.weight_loader = self.loader  # type: ignore[attr-defined]
        return w


class VocabEmbedding(nn.Module):
    """input_ids [num_tokens] -> [num_tokens, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.vocab_shard: VocabShard | None = None

    def shard(self, layout: ParallelLayout) -> None:
        if layout.tp.size > 1 and self.vocab_shard is None:  # a tied head may have asked first
            self.vocab_shard = VocabShard(self.vocab_size, layout.tp)
            self.weight = self.vocab_shard.weight(self.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        vs = self.vocab_shard
        if vs is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - vs.start
        outside = (local < 0) | (local >= vs.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return vs.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


class LMHead(nn.Module):
    """hidden [n, hidden_size] -> float32 logits [n, vocab_size].

    With `tie_to`, the head shares the embedding's weight Parameter, so the checkpoint needs
    no `lm_head.weight` and `named_parameters()` lists the weight once (under the embedding).
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        self.loads_embedding = False  # untied from an embedding another stage holds
        self._tie_to = (tie_to,)  # not a submodule: the embedding is registered where it lives
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.vocab_shard: VocabShard | None = None
        self.packed_weight: torch.Tensor | None = None
        # a GGUF file's head on a CPU: codes per 32 for batches of at most intdot_rows rows
        # (ops/cpu_intdot.py), 8 bits (as the file's Q8_0) or 6 where the file stored the head
        # in 6 bits or fewer (the loader sets code_bits; 0: not a GGUF file's head, no codes)
        self.intdot_weight: cpu_intdot.IntDotWeight | None = None
        self.intdot_rows = 0
        self.code_bits = 0
        # a bfloat16 head on a CPU: batches of at most bf16_rows rows on the bf16 kernel, which
        # reads the dense weight as it is (ops/cpu_bf16.py)
        self.bf16_rows = 0
        # --quantize-lm-head: an e4m3 copy with a float32 scale per vocabulary row
        self.register_buffer("fp8_weight", None)
        self.register_buffer("fp8_scale", None)

    def untie(self) -> None:
        """Hold a weight of its own (a pipeline's last stage, whose embedding is elsewhere);
        it loads from the checkpoint's embedding."""
        self.tied = False
        self.loads_embedding = True
        self._tie_to = (None,)
        self.weight = nn.Parameter(torch.empty(self.vocab_size, self.hidden_size),
                                   requires_grad=False)

    def shard(self, layout: ParallelLayout) -> None:
        """Hold this rank's vocabulary slice (the tied embedding's, sharded first)."""
        if layout.tp.size == 1:
            return
        tie_to = self._tie_to[0]
        if tie_to is not None:
            if tie_to.vocab_shard is None:
                tie_to.shard(layout)
            self.vocab_shard, self.weight = tie_to.vocab_shard, tie_to.weight
        else:
            self.vocab_shard = VocabShard(self.vocab_size, layout.tp)
            self.weight = self.vocab_shard.weight(self.hidden_size)

    def prepack(self, intdot_rows: int = 0, intdot_rounds: int = 2, bf16_rows: int = 0) -> bool:
        """On the CPU, compute through a oneDNN-packed copy of the loaded weight
        (`ops/cpu_linear.py`; the head is the largest product of a small model's step). The
        dense weight stays (the embedding and the speculators read it): one more copy of the
        head in memory. An fp8 head packs its e4m3 values instead (CPUs have no fp8 units; the
        emulation would dequantize them at every step). With `intdot_rows` and `code_bits` (a
        GGUF file's head), batches of at most that many rows run a copy in `code_bits` codes on
        the integer dot kernel (activations rounded `intdot_rounds` times), and the entries
        within 8 of each row's top are recomputed from the dense weight
        (`cpu_linear.exact_near_top`): the sampled token and its logprob are then the dense
        head's. Otherwise, with `bf16_rows` (the CPU plan's), batches of at most that many
        bfloat16 rows of a bfloat16 head run the bf16 kernel on the dense weight. Returns whether
        it packed."""
        w = self.weight.data
        if intdot_rows and self.code_bits and self.fp8_weight is None and w.device.type == "cpu":
            self.intdot_weight = cpu_intdot.quantize_weight(w, intdot_rounds, self.code_bits)
            self.intdot_rows = intdot_rows if self.intdot_weight is not None else 0
        self.bf16_rows = 0
        if (bf16_rows and not self.intdot_rows and self.fp8_weight is None
                and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
                and cpu_bf16.available()):
            self.bf16_rows = bf16_rows
        if self.fp8_weight is not None:
            w = (self.fp8_weight.float() * self.fp8_scale.unsqueeze(-1)).to(w.dtype)
        if not cpu_linear.can_pack(w):
            return False
        self.packed_weight = cpu_linear.pack(w)
        return True

    def quantize_fp8(self) -> None:
        """Compute the logits from an e4m3 copy of the loaded weight (one scale per vocabulary
        row; ops/fp8_linear.py: the fp8 GEMV at decode on GPUs with fp8 units), reading half
        the bytes of a 16-bit head per step. The dense weight stays (the embedding and the
        speculators read it)."""
        q, scale = quantize_rows_fp8(self.weight.data)
        self.fp8_weight, self.fp8_scale = q, scale.reshape(-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits; with a vocabulary split over ranks, gathered on the group's first rank
        (the one that samples): None on the others."""
        logits = self._logits(hidden)
        vs = self.vocab_shard
        if vs is None:
            return logits
        full = vs.tp.gather(logits, dst=0, dim=-1)  # [n, tp * padded]
        return full[:, : self.vocab_size] if full is not None else None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype (as HF's lm_head); only the result is upcast.
        if self.intdot_weight is not None and hidden.shape[0] <= self.intdot_rows:
            logits = cpu_intdot.intdot_mm(hidden.float().contiguous(), self.intdot_weight)
            return cpu_linear.exact_near_top(logits, hidden, self.weight.data)
        if self.bf16_rows and hidden.shape[0] <= self.bf16_rows and hidden.dtype == torch.bfloat16:
            return self._exact_top(cpu_bf16.bf16_mm(hidden, self.weight.data).float(), hidden)
        if self.packed_weight is not None:
            if self.fp8_weight is not None:  # W8A8: the activations quantized per token
                hidden = fake_quantize_rows_fp8(hidden).to(hidden.dtype)
            return self._exact_top(cpu_linear.packed_linear(hidden, self.packed_weight).float(),
                                   hidden)
        if self.fp8_weight is not None:
            # x quantized per row by a kernel of its own (rows_first): one launch, where the
            # GEMV's ~2,000 programs over the vocabulary would each quantize it again
            return fp8_linear(hidden, self.fp8_weight, self.fp8_scale, rows_first=True).float()
        if hidden.device.type != "cpu":
            return F.linear(hidden, self.weight).float()
        return self._exact_top(cpu_bf16.dense_linear(hidden, self.weight).float(), hidden)

    def kernel(self, rows: int = 1) -> str:
        """The product a CPU batch of `rows` bfloat16 rows takes in `_logits` (start-up reports
        and benchmarks: what a decode step's head reads)."""
        if self.intdot_weight is not None and rows <= self.intdot_rows:
            return f"intdot{self.code_bits}"
        if self.bf16_rows and rows <= self.bf16_rows:
            return "bf16"
        if self.packed_weight is not None:
            return "onednn-fp8" if self.fp8_weight is not None else "onednn"
        return "fp8" if self.fp8_weight is not None else "dense"

    def _exact_top(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """On the CPU (whose plan runs small models in bfloat16) the entries near each row's
        maximum are recomputed in float32, so a 16-bit head's rounding does not turn near-ties
        into ties that the greedy token breaks by index (`cpu_linear.exact_near_max`). GPUs
        keep the plain head: the recomputation's shape depends on the values, which CUDA
        graphs cannot hold. An fp8 head is left as computed."""
        if self.fp8_weight is not None:
            return logits
        return cpu_linear.exact_near_max(logits, hidden, self.weight.data)

    def extra_repr(self) -> str:
        fp8 = ", fp8" if self.fp8_weight is not None else ""
        return f"{self.vocab_size}, tied={self.tied}{fp8}"
