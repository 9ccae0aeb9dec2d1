"""Per-layer formats and the mixed-precision search, on a tiny random HF Llama: a mixed
assignment survives a checkpoint round trip (formats and logits), byte counts are exact and
the budget holds, suffix re-runs score like full runs, the search is at least as good as every
uniform format that fits, and the CLI reports impossible budgets in one line."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from skyline.config import ConfigError, QuantConfig
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.model.checkpoint import write_checkpoint
from skyline.model.loader import load_model
from skyline.quant.assignment import (
    Format,
    linear_bytes,
    parse_budget,
    parse_format,
    parse_formats,
    stored_bytes,
    to_quant_config,
)
from skyline.quant.base import QuantLinearMethod
from skyline.quant.calibrate import collect_act_sq
from skyline.quant.checkpoint import quantize_loaded
from skyline.quant.joint import JointKL, linears, quantize_choices, spread_windows, swap_in
from skyline.quant.report import install, search_report
from skyline.quant.search import search, solve_knapsack

transformers = pytest.importorskip("transformers")

CALIB = [(7 * i + 3) % 256 for i in range(192)]
FORMATS = parse_formats("mxfp4,nvfp4,int4-g32,int8")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    _byte_tokenizer(path)
    return str(path)


def _byte_tokenizer(path) -> None:
    """A byte-level tokenizer.json over the 256-token vocabulary (for the CLI's text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


def model_cfg(path: str):
    cfg, _ = create_engine_config(EngineArgs(model=path, dtype="float32", device="cpu"))
    return cfg.model


def logits(model) -> torch.Tensor:
    ids = torch.tensor(CALIB[:40])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def test_parse_formats_and_budgets():
    assert parse_format("int4-g32") == Format("int4", 32)
    assert parse_format("int8", group_size=64) == Format("int8", 64)
    assert parse_format("NVFP4") == Format("nvfp4") and Format("int4", 32).name == "int4-g32"
    assert parse_formats("int4,int4-g128,nvfp4") == [Format("int4"), Format("nvfp4")]
    for bad in ("int3", "nvfp4-g32", "int4-g48", "gguf"):
        with pytest.raises(ConfigError):
            parse_format(bad)
    assert parse_budget("4.5", 1000) == 562 and parse_budget("4.5bpw", 1000) == 562
    assert parse_budget("2MiB", 1000) == 2 << 20
    with pytest.raises(ConfigError, match="out of range"):
        parse_budget("48", 1000)
    with pytest.raises(ConfigError, match="as a size"):
        parse_budget("lots", 1000)


def test_budget_named_by_a_format_is_its_uniform_size(hf_dir):
    lin = linears(load_model(model_cfg(hf_dir), "cpu"))
    num_weights = sum(m.in_features * m.out_features for m in lin.values())
    want = sum(linear_bytes(m, Format("int4", 32)) for m in lin.values())
    assert parse_budget("int4-g32", num_weights, lin) == want
    assert parse_budget("int4", num_weights, lin, group_size=32) == want
    with pytest.raises(ConfigError, match="cannot read --budget 'lots'"):
        parse_budget("lots", num_weights, lin)


def test_knapsack_is_optimal_and_fits():
    rng = random.Random(0)
    for _ in range(50):
        costs = [[rng.random() for _ in range(3)] for _ in range(4)]
        sizes = [[rng.randint(1, 30) for _ in range(3)] for _ in range(4)]
        budget = rng.randint(10, 100)
        feasible = [p for p in itertools.product(range(3), repeat=4)
                    if sum(sizes[i][j] for i, j in enumerate(p)) <= budget]
        picks = solve_knapsack(costs, sizes, budget)  # resolution > budget: exact
        if not feasible:
            assert picks is None
            continue
        best = min(sum(costs[i][j] for i, j in enumerate(p)) for p in feasible)
        assert sum(costs[i][j] for i, j in enumerate(picks)) == pytest.approx(best)
        coarse = solve_knapsack(costs, sizes, budget, resolution=7)  # rounded sizes still fit
        if coarse is not None:
            assert sum(sizes[i][j] for i, j in enumerate(coarse)) <= budget


MIXED = QuantConfig(method="int4", group_size=32, layers=(
    ("model.layers.0.self_attn.qkv_proj", "int8", 64),
    ("model.layers.0.self_attn.o_proj", "none", 128),
    ("model.layers.0.mlp.*", "nvfp4", 128),
    ("model.layers.1.self_attn.*", "fp8", 128),
    ("model.layers.1.mlp.down_proj", "mxfp4", 128),
))


def test_mixed_checkpoint_round_trip(hf_dir, tmp_path):
    cfg = model_cfg(hf_dir)
    mem = load_model(cfg, "cpu")
    act_sq = collect_act_sq(mem, CALIB)
    quantize_loaded(mem, MIXED, act_sq)
    write_checkpoint(mem, cfg, MIXED, str(tmp_path), {"source": "token ids", "tokens": 192})
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["layers"]["model.layers.0.mlp.down_proj"] == {"format": "nvfp4",
                                                              "group_size": 128}
    assert len(saved["layers"]) == 8  # every Linear's own format is recorded

    loaded_cfg = model_cfg(str(tmp_path))
    assert loaded_cfg.quant.prequantized and loaded_cfg.quant.layers
    loaded = load_model(loaded_cfg, "cpu")
    for name, layer in linears(loaded).items():
        want = MIXED.for_layer(name)
        method = layer.linear_method
        if want.method == "none":
            assert not isinstance(method, QuantLinearMethod), name
        else:
            assert method.name == want.method, name
            assert want.method not in ("int4", "int8") or method.group_size == want.group_size
        fmt = Format(want.method, want.group_size)
        assert stored_bytes(layer) == linear_bytes(layer, fmt), name  # exact byte count
    want_params = dict(mem.named_parameters())
    got_params = dict(loaded.named_parameters())
    assert want_params.keys() == got_params.keys()
    for name, t in want_params.items():
        assert t.dtype == got_params[name].dtype and torch.equal(t, got_params[name]), name
    assert torch.equal(logits(loaded), logits(mem))
    with pytest.raises(ConfigError, match="already quantized with per-layer formats"):
        create_engine_config(EngineArgs(model=str(tmp_path), quantization="int8"))


def test_suffix_rerun_scores_like_full_run(hf_dir):
    model = load_model(model_cfg(hf_dir), "cpu")
    choices = quantize_choices(model, FORMATS, None, CALIB[:32])
    scorer = JointKL(model, [CALIB[:48], CALIB[48:96]])
    lin = linears(model)
    assert scorer.score(0)[0] == pytest.approx(0.0, abs=1e-9)
    swap_in(lin, choices, {n: Format("int4", 32) for n in lin})
    kl_all, token = scorer.score(0)
    scorer.commit(token)
    name = "model.layers.1.mlp.down_proj"
    swap_in(lin, choices, {**{n: Format("int4", 32) for n in lin}, name: Format("mxfp4")})
    suffix, _ = scorer.score(scorer.block_of[name])
    full, _ = scorer.score(0)
    assert suffix == pytest.approx(full, rel=1e-6) and suffix != pytest.approx(kl_all)


def _uniform_bytes(model, fmt: Format) -> int:
    return sum(linear_bytes(m, fmt) for m in linears(model).values())


@pytest.mark.parametrize("budget_of", ["nvfp4", "6.0"])
def test_search_fits_budget_and_beats_uniform(hf_dir, budget_of):
    model = load_model(model_cfg(hf_dir), "cpu")
    ref_logits = logits(model)
    act_sq = collect_act_sq(model, CALIB)
    num_weights = sum(m.in_features * m.out_features for m in linears(model).values())
    budget = (_uniform_bytes(model, Format("nvfp4")) if budget_of == "nvfp4"
              else parse_budget(budget_of, num_weights))
    result = search(model, CALIB, FORMATS, budget, act_sq, search_tokens=96, window=48,
                    max_evals=24)
    assert torch.equal(logits(model), ref_logits)  # the model is left unquantized
    assert result.nbytes <= budget
    assert result.nbytes == sum(linear_bytes(m, result.assignment[n])
                                for n, m in linears(model).items())

    # Score every candidate independently, with the real quantized methods, on the same tokens.
    windows = spread_windows(CALIB, 96, 48)  # the search's windows
    assert windows == [CALIB[:48], CALIB[144:]]
    ref_weights = {n: m.weight.data for n, m in linears(model).items()}
    scorer = JointKL(model, windows)

    def joint_kl(assignment):
        install(model, assignment, result.choices, ref_weights)
        return scorer.score(0)[0]

    mixed = joint_kl(result.assignment)
    assert sum(stored_bytes(m) for m in linears(model).values()) == result.nbytes
    assert mixed == pytest.approx(result.kl, rel=1e-4)
    uniform = [joint_kl({n: f for n in ref_weights}) for f in FORMATS
               if _uniform_bytes(model, f) <= budget]
    assert uniform and mixed <= min(uniform) * (1 + 1e-4)


def test_search_report_scores_held_out_text(hf_dir):
    model = load_model(model_cfg(hf_dir), "cpu")
    ids = CALIB * 2
    budget = _uniform_bytes(model, Format("int4", 32))
    result, report = search_report(model, ids, FORMATS, budget, None, calib_tokens=192,
                                   eval_tokens=128, eval_window=64, search_tokens=96,
                                   window=48, max_evals=8)
    assert report["eval_tokens"] == 128 and report["mixed"]["bytes"] == result.nbytes
    best = report["best_uniform_within_budget"]
    assert best["bytes"] <= budget and best["variant"].startswith("uniform")
    assert {r["variant"] for r in report["results"]} >= {f"uniform {f.name}" for f in FORMATS}
    q = to_quant_config(result.assignment)
    assert all(q.for_layer(n) == f.quant_config() for n, f in result.assignment.items())


def test_cli_rejects_impossible_budgets(hf_dir, tmp_path):
    from skyline.cli import main

    args = ["quantize", hf_dir, "--out", str(tmp_path), "--search"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--budget", "3.5", "--formats", "int4,int8"])
    msg = str(e.value)
    assert msg.startswith("skyline: error: a budget of") and "below the smallest" in msg
    assert "\n" not in msg
    with pytest.raises(SystemExit) as e:
        main(args)
    assert str(e.value).startswith("skyline: error: --search needs --budget")
    with pytest.raises(SystemExit) as e:
        main([*args, "--budget", "4.5", "--formats", "int4,int3"])
    assert str(e.value).startswith("skyline: error: cannot read format 'int3'")


def test_cli_search_writes_checkpoint_assignment_and_report(hf_dir, tmp_path, capsys):
    from skyline.cli import main

    text = tmp_path / "calib.txt"
    text.write_text("We the People of the United States, in Order to form a more perfect "
                    "Union, establish Justice, insure domestic Tranquility. " * 4)
    out = tmp_path / "out"
    main(["quantize", hf_dir, "--search", "--budget", "6", "--formats", "nvfp4,int4-g32,int8",
          "--out", str(out), "--calib-file", str(text), "--calib-tokens", "256",
          "--eval-tokens", "128", "--search-tokens", "128", "--max-evals", "4"])
    printed = capsys.readouterr().out
    assert "| mixed (searched) |" in printed and "best uniform within budget" in printed
    assignment = json.loads((out / "assignment.json").read_text())
    assert len(assignment["layers"]) == 8 and assignment["bytes"] <= assignment["budget_bytes"]
    report = json.loads((out / "report.json").read_text())
    assert report["mixed"]["bytes"] == assignment["bytes"]
    loaded = load_model(model_cfg(str(out)), "cpu")
    for name, layer in linears(loaded).items():
        fmt = parse_format(assignment["layers"][name])
        assert stored_bytes(layer) == linear_bytes(layer, fmt)
    assert torch.isfinite(logits(loaded)).all()

    from skyline.engine.frontend.llm import LLM
    from skyline.types import SamplingParams

    llm = LLM(model=str(out), num_blocks=32, dtype="float32", device="cpu")
    outs = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 4  # the engine serves the mixed checkpoint
