"""Tiny pre-quantized checkpoints in other tools' layouts, packed here from each format's
documentation (GPTQ, AWQ, ModelOpt, gpt-oss's MXFP4; compressed-tensors through its own
library), with the dequantized weight every quantized Linear stands for, the reference the
loaded model is checked against."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

transformers = __import__("transformers")

IDS = torch.tensor([(37 * i + 11) % 256 for i in range(24)])
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that read the same input, so share one activation order.
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}


def tiny_llama(seed: int = 0):
    """2 layers, hidden 128 (4 heads of 32, 2 KV heads: k/v 64 rows), MLP 256, vocab 256."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        architectures=["LlamaForCausalLM"])
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.06)
    return model


def linear_weights(model) -> dict[str, torch.Tensor]:
    """HF module name -> float32 weight [N, K] of every quantizable Linear."""
    return {name: m.weight.detach().float().clone() for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in LINEARS}


def write(model, out: Path, tensors: dict[str, torch.Tensor], quant: dict | None,
          config_name: str = "config.json") -> str:
    """The model's config.json (with `quant` as quantization_config) and its tensors: the
    non-Linear weights as they are, plus `tensors`."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if quant is not None:
        cfg = json.loads((out / "config.json").read_text())
        if config_name == "config.json":
            cfg["quantization_config"] = quant
        else:
            (out / config_name).write_text(json.dumps(quant))
        (out / "config.json").write_text(json.dumps(cfg))
    state = {n: p.detach().contiguous() for n, p in model.state_dict().items()
             if n.rsplit(".", 2)[-2] not in LINEARS and "rotary" not in n}
    state.update({n: t.contiguous() for n, t in tensors.items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def dequantized_model(model, deq: dict[str, torch.Tensor]):
    """A copy of the HF model with each quantized Linear's weight replaced by its
    dequantized one: the float model the checkpoint stands for."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if name in deq:
                m.weight.copy_(deq[name])
    return ref


# -- GPTQ / AWQ ----------------------------------------------------------------------------


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unsigned codes -> int32 words along `dim`: element (32 / bits) * j + order[i] in bits
    [bits * i, bits * (i + 1)) of word j (GPTQ's and AWQ's packing)."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, per)
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.arange(per) * bits
    words = (c << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def quantize_asym(w: torch.Tensor, bits: int, cols: list[torch.Tensor], sym: bool):
    """GPTQ-style round-to-nearest of w [N, K] over groups of columns `cols` (index tensors):
    codes [N, K], fp16 scales [N, G], zeros [N, G] (sym: 2^(bits - 1))."""
    qmax = 2**bits - 1
    n, k = w.shape
    codes = torch.zeros(n, k, dtype=torch.int64)
    scales = torch.zeros(n, len(cols), dtype=torch.float16)
    zeros = torch.zeros(n, len(cols), dtype=torch.int64)
    for g, idx in enumerate(cols):
        wg = w[:, idx]
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        if sym:
            amax = torch.maximum(-lo, hi)
            s = (2 * amax / qmax).half()
            z = torch.full((n,), 2 ** (bits - 1), dtype=torch.int64)
        else:
            s = ((hi - lo) / qmax).half()
            z = torch.round(-lo / s.float()).long().clamp(0, qmax)
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes[:, idx] = (torch.round(wg / s.float()[:, None]) + z[:, None]).clamp(0, qmax).long()
        scales[:, g], zeros[:, g] = s, z
    return codes, scales, zeros


def gptq_checkpoint(model, out: Path, bits=4, group=128, desc_act=False, sym=True,
                    fmt="gptq", awq=False) -> tuple[str, dict[str, torch.Tensor]]:
    """A GPTQ (or AWQ "gemm") checkpoint of `model` and its dequantized weights."""
    tensors, deq = {}, {}
    gen = torch.Generator().manual_seed(5)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    for name, w in linear_weights(model).items():
        k = w.shape[1]
        layer, proj = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        key = (layer, INPUT_OF[proj])
        if key not in perms:  # the activation order of this input: shared by its projections
            perms[key] = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        perm = perms[key]
        gs = group if group > 0 else k
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // gs).int()
        cols = [perm[i:i + gs] for i in range(0, k, gs)]
        codes, scales, zeros = quantize_asym(w, bits, cols, sym)
        gi = g_idx.long()
        deq[name] = (codes - zeros[:, gi]).float() * scales.float()[:, gi]
        if awq:
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors[f"{name}.qweight"] = pack_int32(codes.t(), bits, 1, order)
            tensors[f"{name}.qzeros"] = pack_int32(zeros.t(), bits, 1, order)
        else:
            stored = (zeros - (1 if fmt == "gptq" else 0)) & (2**bits - 1)
            tensors[f"{name}.qweight"] = pack_int32(codes.t(), bits, 0)
            tensors[f"{name}.qzeros"] = pack_int32(stored.t(), bits, 1)
            tensors[f"{name}.g_idx"] = g_idx
        tensors[f"{name}.scales"] = scales.t()
    if awq:
        quant = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                 "version": "gemm"}
    else:
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                 "sym": sym, "checkpoint_format": fmt, "static_groups": False}
    return write(model, out, tensors, quant), deq


# -- compressed-tensors (its own library) --------------------------------------------------


def ct_checkpoint(model, out: Path, preset: str, group: int | None = None,
                  input_scale: float = 0.05) -> tuple[str, dict[str, torch.Tensor]]:
    """A compressed-tensors checkpoint of `model` with one of the library's preset schemes
    (group size changed where given), scales from each tensor's min/max, and the weights the
    library dequantizes it to."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    model = copy.deepcopy(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:
        scheme.weights.group_size = group
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    deq = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            sch = getattr(m, "quantization_scheme", None)
            if sch is None:
                continue
            w, args = m.weight.float(), sch.weights
            gscale = None
            if args.strategy == "tensor_group":
                gscale = generate_gparam(w.amin(), w.amax())
                m.weight_global_scale.copy_(gscale)
            lo, hi = _min_max(w, args)
            s, z = calculate_qparams(lo, hi, args, global_scale=gscale)
            m.weight_scale.copy_(s.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(z.reshape(m.weight_zero_point.shape))
            if hasattr(m, "input_scale"):
                m.input_scale.fill_(input_scale)
            deq[name] = fake_quantize(m.weight, m.weight_scale,
                                      getattr(m, "weight_zero_point", None), args,
                                      global_scale=gscale).float()
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    comp.update_config(str(out))
    return str(out), deq


def _min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy in ("group", "tensor_group"):
        g = w.reshape(w.shape[0], -1, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure  # block: pad to whole blocks, as the library does
    wp = torch.nn.functional.pad(w, (0, -w.shape[1] % bk, 0, -w.shape[0] % bn))
    g = wp.reshape(wp.shape[0] // bn, bn, wp.shape[1] // bk, bk)
    return g.amin((1, 3)), g.amax((1, 3))
