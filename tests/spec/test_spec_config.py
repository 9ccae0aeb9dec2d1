"""SpecConfig validation and its CLI flags."""

from __future__ import annotations

import pytest

from skyline.cli import build_parser, engine_args
from skyline.config import ConfigError, SpecConfig


def test_spec_config_validation():
    assert not SpecConfig().enabled
    assert SpecConfig(method="suffix").enabled
    with pytest.raises(ConfigError, match="--speculative-method must be one of"):
        SpecConfig(method="eagle3")
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        SpecConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="ngram_min <= ngram_max"):
        SpecConfig(method="ngram", ngram_min=4, ngram_max=2)


def test_cli_flags_reach_engine_args():
    ns = build_parser().parse_args(["generate", "hi", "--speculative-method", "ngram",
                                    "--num-speculative-tokens", "7", "--ngram-max", "6"])
    args = engine_args(ns)
    assert args.speculative_method == "ngram" and args.num_speculative_tokens == 7
    assert args.ngram_max == 6 and args.speculative_max_batch_tokens is None
