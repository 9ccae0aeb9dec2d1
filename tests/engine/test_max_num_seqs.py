"""max_num_seqs "auto": from the KV cache's capacity and the CUDA-graph batch sizes on GPUs,
64 on the CPU; an explicit value wins."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.engine.core import EngineCore
from skyline.engine.create import create_engine_config
from skyline.engine.create.resolve import _resolve_max_num_seqs
from skyline.worker.cuda_graph import MAX_GRAPH_BATCH, auto_max_num_seqs, bucket_sizes


@pytest.mark.parametrize("kv_tokens,max_len,expected", [
    (780_000, 131_072, 352),  # bf16 Llama-3.1-8B on an H200: 380 sequences of 2,048 tokens fit
    (1_600_000, 131_072, 768),  # the same with an fp8 cache
    (50_000, 131_072, 256),  # a small cache: never below the old fixed default
    (10**9, 131_072, MAX_GRAPH_BATCH),  # capped at the largest graph
    (300_000, 512, 576),  # short contexts: 585 sequences of 512 tokens -> the graph of 576
])
def test_auto_max_num_seqs_is_a_graph_size_that_fits(kv_tokens, max_len, expected):
    n, why = auto_max_num_seqs(kv_tokens, max_len)
    assert n == expected
    assert n in bucket_sizes(MAX_GRAPH_BATCH)
    assert f"{kv_tokens:,} tokens" in why


def test_resolution_of_the_flag():
    assert _resolve_max_num_seqs("auto", on_gpu=False) == (64, False)
    assert _resolve_max_num_seqs(None, on_gpu=False) == (64, False)
    assert _resolve_max_num_seqs("auto", on_gpu=True) == (MAX_GRAPH_BATCH, True)
    assert _resolve_max_num_seqs("32", on_gpu=True) == (32, False)
    assert _resolve_max_num_seqs(300, on_gpu=True) == (300, False)
    with pytest.raises(ConfigError, match="number or auto"):
        _resolve_max_num_seqs("lots", on_gpu=True)
    with pytest.raises(ConfigError, match="at least 1"):
        _resolve_max_num_seqs("0", on_gpu=False)
    cfg, _ = create_engine_config(EngineArgs(model="llama-3.1-8b", load_format="dummy",
                                             device="cpu"))
    assert cfg.scheduler.max_num_seqs == 64 and not cfg.scheduler.max_num_seqs_auto


def test_engine_core_takes_the_runners_choice(tiny_llama, caplog):
    cfg, _ = create_engine_config(EngineArgs(model=tiny_llama(), device="cpu", num_blocks=96))
    sched = dataclasses.replace(cfg.scheduler, max_num_seqs=MAX_GRAPH_BATCH,
                                max_num_seqs_auto=True)
    with caplog.at_level(logging.INFO, logger="skyline.worker.runner"):
        core = EngineCore(dataclasses.replace(cfg, scheduler=sched))
    try:
        expected, _ = auto_max_num_seqs(96 * cfg.cache.block_size, cfg.scheduler.max_model_len)
        assert core.config.scheduler.max_num_seqs == expected
        assert core.scheduler.cfg.max_num_seqs == expected
        assert any("max_num_seqs" in r.message and "auto" in r.message for r in caplog.records)
    finally:
        core.shutdown()
