"""Pieces of the server path without a server: the msgpack codec, structured-output masks and
their application to logits."""

from __future__ import annotations

import json

import pytest
import torch

from skyline.engine.codec import (
    pack,
    request_from_dict,
    request_to_dict,
    step_output_from_list,
    step_output_to_list,
    unpack,
)
from skyline.engine.frontend.structured import (
    StructuredOutputs,
    check_structured,
    make_ll_tokenizer,
)
from skyline.types import (
    CachedRequestData,
    NewRequestData,
    Request,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutput,
    TokenLogprobs,
)
from skyline.worker.sampler import apply_token_masks


def test_codec_round_trip():
    params = SamplingParams(n=1, temperature=0.5, stop=["x"], seed=2**63, logprobs=3,
                            json_schema={"type": "object", "properties": {"a": {"type": "number"}}})
    req = Request("r1", [1, 2, 3], params, eos_token_ids=(2, 7))
    back = request_from_dict(unpack(pack(request_to_dict(req))))
    assert (back.request_id, back.prompt_token_ids, back.eos_token_ids) == ("r1", [1, 2, 3], (2, 7))
    assert back.sampling_params == params
    out = StepOutput("r1", [5], [TokenLogprobs([5, 6], [-0.1, -2.5], 1)], "stop", "</s>", 3, 16)
    assert step_output_from_list(unpack(pack(step_output_to_list(out)))) == out
    bare = StepOutput("r2", [], None)
    assert step_output_from_list(unpack(pack(step_output_to_list(bare)))) == bare


@pytest.mark.parametrize("params, match", [
    (SamplingParams(json_schema={"type": "no-such-type"}), "json_schema"),
    (SamplingParams(json_schema="{not json"), "not valid JSON"),
    (SamplingParams(regex="a(b"), "regex"),
    (SamplingParams(grammar="start: missing_rule"), "grammar"),
])
def test_check_structured_rejects(params, match):
    with pytest.raises(ValueError, match=match):
        check_structured(params)


def test_check_structured_accepts():
    check_structured(SamplingParams())
    check_structured(SamplingParams(json_schema={"type": "object"}))
    check_structured(SamplingParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(json_schema={"type": "object"}, regex="x").validate()


def test_apply_token_masks():
    logits = torch.zeros(3, 70)
    allow = torch.zeros(3, 3, dtype=torch.int32)
    allow[0, 0] = 0b101  # tokens 0 and 2
    allow[0, 2] = 1 << 3  # token 67
    apply_token_masks(logits, [allow[0].numpy().tobytes(), None, allow[2].numpy().tobytes()])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [0, 2, 67]
    assert (logits[1] == 0).all()
    assert torch.isinf(logits[2]).all()


@pytest.fixture(scope="module")
def tokenizer():
    from skyline.engine.frontend.tokenizer import Tokenizer
    from skyline.model.default import default_model_path

    return Tokenizer.load(default_model_path())


def test_structured_outputs_masks(tokenizer):
    vocab = tokenizer.vocab_size
    eos = tuple(tokenizer.eos_token_ids)
    so = StructuredOutputs(lambda: make_ll_tokenizer(tokenizer, vocab, eos), eos, vocab)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(json_schema=schema)
    prompt = tokenizer.encode("Give JSON:")
    out = SchedulerOutput(
        new_requests=[NewRequestData("r", prompt, [], params, [0], 0),
                      NewRequestData("plain", prompt, [], SamplingParams(), [1], 0)],
        num_scheduled_tokens={"r": len(prompt), "plain": len(prompt)})
    so.before_step(out)
    assert set(out.token_masks) == {"r"}  # only constrained requests get a mask

    def allowed(mask: bytes) -> list[int]:
        bits = torch.zeros(vocab)
        apply_token_masks(bits[None], [mask])
        return (bits == 0).nonzero().flatten().tolist()

    first = allowed(out.token_masks["r"])
    assert first and all(tokenizer.decode([t]).startswith("{") for t in first)
    # Walk the matcher along a valid answer, token by token, then expect only EOS.
    text_ids = tokenizer.encode('{"a": 12}', add_special_tokens=False)
    for k, tok in enumerate(text_ids, start=1):
        assert tok in allowed(out.token_masks["r"])
        so.after_step(out, RunnerOutput(req_ids=["r"], sampled_token_ids=[[tok]]))
        # a decode step: prompt + k - 1 tokens in the KV cache, one more scheduled
        out = SchedulerOutput(cached_requests=[CachedRequestData("r", [], len(prompt) + k - 1)],
                              num_scheduled_tokens={"r": 1})
        so.before_step(out)
    assert set(allowed(out.token_masks["r"])) <= set(eos)  # the object is complete
    so.before_step(SchedulerOutput(finished_request_ids={"r"}))
    assert not so.matchers


def test_a_tokenizer_llguidance_cannot_read_refuses_constrained_requests():
    calls = []

    def unreadable():
        calls.append(1)
        raise ValueError("can't determine decoder type")

    so = StructuredOutputs(unreadable, (2,), 64)
    so.admit(SamplingParams())  # unconstrained: no tokenizer needed
    for _ in range(2):
        with pytest.raises(ValueError, match="tokenizer cannot be used for constrained"):
            so.admit(SamplingParams(regex="a+"))
    assert len(calls) == 1  # tried once


def test_json_schema_text_round_trip():
    schema = {"type": "object"}
    assert check_structured(SamplingParams(json_schema=json.dumps(schema))) is None


def test_metrics_export_speculation_by_position_and_the_gate():
    from prometheus_client.parser import text_string_to_metric_families

    from skyline.server.metrics import Metrics

    stats = {"spec_acceptance_pos_0": 0.75, "spec_acceptance_pos_1": 0.5,
             "spec_gate_speculated_fraction": 0.25, "spec_gate_b8_spec_tokens_per_s": 120.0,
             "spec_gate_b8_plain_tokens_per_s": 90.0, "spec_gate_b8_speculating": 1.0}
    text = Metrics("m", lambda: stats).render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("skyline:spec_decode_speculated_fraction", (("model_name", "m"),))] == 0.25
    key = (("model_name", "m"), ("position", "1"))
    assert samples[("skyline:spec_decode_acceptance_by_position", key)] == 0.5
    key = (("batch", "8"), ("mode", "spec"), ("model_name", "m"))
    assert samples[("skyline:spec_decode_gate_tokens_per_second", key)] == 120.0
    key = (("batch", "8"), ("mode", "plain"), ("model_name", "m"))
    assert samples[("skyline:spec_decode_gate_tokens_per_second", key)] == 90.0


def test_metrics_export_kv_tiers():
    from prometheus_client.parser import text_string_to_metric_families

    from skyline.cache.offload import TierConnector, TierLayout
    from skyline.server.metrics import Metrics

    stats = TierConnector(TierLayout(8, 16), 4, False, 2).stats()
    stats |= {"prefix_cache_query_tokens": 100, "kv_offload_ram_hit_tokens": 12,
              "kv_offload_disk_hit_tokens": 8, "kv_offload_load_failed_blocks": 1}
    text = Metrics("m", lambda: stats).render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    m = (("model_name", "m"),)
    assert samples[("skyline:external_prefix_cache_hits_total", m)] == 20
    assert samples[("skyline:external_prefix_cache_queries_total", m)] == 100
    assert samples[("skyline:kv_offload_hit_tokens_total", (*m, ("tier", "disk")))] == 8
    assert samples[("skyline:kv_offload_capacity_blocks", (*m, ("tier", "ram")))] == 8
    assert samples[("skyline:kv_offload_failed_blocks_total", (("model_name", "m"),
                                                                ("op", "load")))] == 1
    assert not any("kv_offload" in k[0] for k in _samples_without_tiers())


def _samples_without_tiers():
    from prometheus_client.parser import text_string_to_metric_families

    from skyline.server.metrics import Metrics

    text = Metrics("m", lambda: {}).render().decode()
    return [(s.name, s.labels) for f in text_string_to_metric_families(text) for s in f.samples]


def test_metrics_of_several_api_processes_pass_over_a_file_being_created(tmp_path):
    """Another API process's file, created and not yet sized (empty for an instant), neither
    stops this one's start nor its /metrics (reading it raised struct.error)."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from skyline.server.metrics import Metrics

    # a peer's file as prometheus_client writes it, and one just created
    peer = MmapedDict(str(tmp_path / "counter_7.db"))
    peer.write_value(mmap_key("x", "x_total", (), (), "x."), 3.0, 0.0)
    peer.close()
    (tmp_path / "counter_8.db").touch()
    text = Metrics("m", lambda: {}, multiprocess_dir=str(tmp_path)).render().decode()
    assert "x_total 3.0" in text
