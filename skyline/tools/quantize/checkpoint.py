"""`skyline quantize`: quantize a model's Linear weights (optionally calibrated on text) and
write a safetensors checkpoint that skyline loads directly (config.json names the format
under `quantization_config`, so loading needs no --quantization). A mixed-precision
checkpoint (report.py, `--search`) also lists every Linear's own format under "layers".

The model is loaded by an engine on the CPU; calibration, quantization and writing the
weights are its queries (worker/queries.py); the tokenizer's files are written here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from skyline.config import SAVABLE_METHODS, ConfigError, ModelConfig, QuantConfig
from skyline.engine.frontend.llm import LLM
from skyline.tools import builtin_text

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja", "chat_template.json")


def load_for_tools(model_cfg: ModelConfig) -> LLM:
    """An engine holding the unquantized model of `model_cfg` on the CPU, in its dtype, for
    queries that read its weights: a KV cache of one block, no prefix caching."""
    if model_cfg.quant.method != "none" or model_cfg.quant.layers:
        raise ConfigError("skyline quantize needs an unquantized model; pass the original one")
    return LLM(model=model_cfg.path, load_format=model_cfg.load_format, dtype=model_cfg.dtype,
               device="cpu", quantization="none", seed=model_cfg.seed, num_blocks=1,
               block_size=16, max_model_len=16, enable_prefix_caching=False)


def write_tokenizer(llm: LLM, model_cfg: ModelConfig, out: Path) -> None:
    """The tokenizer beside a checkpoint: a GGUF's as tokenizer.json and tokenizer_config.json,
    a HF directory's files as they are."""
    if model_cfg.load_format == "gguf":
        tok = llm.tokenizer
        assert tok is not None  # a GGUF file always carries its tokenizer
        tok.backend.save(str(out / "tokenizer.json"))
        cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
               "pad_token": tok.pad_token, "chat_template": tok.chat_template}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        return
    for name in _TOKENIZER_FILES:
        src = Path(model_cfg.path) / name
        if src.is_file():
            shutil.copy(src, out / name)


def save(llm: LLM, model_cfg: ModelConfig, quant: QuantConfig, out_dir: str,
         calibration: dict[str, Any]) -> dict[str, Any]:
    """Write the engine's quantized model and its tokenizer to `out_dir`; returns the
    quantization_config."""
    meta = llm.query("save_quantized", out_dir, quant, calibration)
    write_tokenizer(llm, model_cfg, Path(out_dir))
    return meta


def quantize_checkpoint(
    model_cfg: ModelConfig, fmt: str, out_dir: str, group_size: int = 128,
    calib_text: str | None = None, calib_ids: list[int] | None = None,
    calib_tokens: int = 4096,
) -> dict[str, Any]:
    """Load `model_cfg` (unquantized), calibrate on `calib_ids` or the tokenized `calib_text`
    (the built-in text when both are None and the model has a tokenizer), quantize to `fmt`,
    write `out_dir`. Returns the quantization_config written."""
    if fmt not in SAVABLE_METHODS:
        raise ConfigError(f"--format must be one of {', '.join(SAVABLE_METHODS)}, got {fmt!r}")
    qcfg = QuantConfig(method=fmt, group_size=group_size)
    llm = load_for_tools(model_cfg)
    try:
        source = "token ids"
        if calib_ids is None:
            if llm.tokenizer is None:
                log.warning("%s has no tokenizer; quantizing without calibration", model_cfg.path)
            else:
                source = "built-in text" if calib_text is None else "given text"
                text = calib_text if calib_text is not None else builtin_text()
                calib_ids = llm.tokenizer.encode(text)
        act_sq = None
        if calib_ids:
            calib_ids = calib_ids[:calib_tokens]
            act_sq = llm.query("collect_act_sq", calib_ids)
        llm.query("quantize", qcfg, act_sq)
        calibration = {"source": source if act_sq else "none", "tokens": len(calib_ids or [])}
        return save(llm, model_cfg, qcfg, out_dir, calibration)
    finally:
        llm.shutdown()
