"""The decode-overlap probe (worker/overlap_probe.py): every way it runs a batch gives the
hidden states the whole batch gives, and a batch the cache cannot hold is refused."""

from __future__ import annotations

import pytest
import torch

from skyline.bench.smoke import tiny_model
from skyline.engine.frontend.llm import LLM

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def probe(device: str, *args):
    llm = LLM(tiny_model(), load_format="dummy", device=device, max_model_len=128,
              max_num_seqs=8, kv_cache_memory="16MiB")
    try:
        return llm.query("decode_overlap_seconds", *args)
    finally:
        llm.shutdown()


def test_halves_give_the_whole_batch_hidden_states():
    rows = probe("cpu", 7, 50, (), 1)  # an odd batch: halves of 3 and 4
    assert [r["variant"] for r in rows] == ["one", "halves"]
    assert rows[0]["max_rel_diff"] == 0.0 and rows[1]["max_rel_diff"] < 1e-5
    assert all(r["seconds"] > 0 for r in rows)


def test_a_batch_the_cache_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="KV blocks"):
        probe("cpu", 8, 1 << 20, (), 1)


@CUDA
@pytest.mark.cuda
def test_streams_and_turns_give_the_whole_batch_hidden_states():
    rows = probe("cuda", 7, 50, (8,), 2)
    names = [r["variant"] for r in rows]
    assert names[:4] == ["one", "halves", "streams", "alternate"]
    assert all(r["error"] is None and r["max_rel_diff"] < 2e-2 for r in rows), rows

