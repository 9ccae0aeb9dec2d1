"""Kernel launch configurations as data (skyline/ops/tuning.py): lookup with fallback, the
writer's merge, clear errors for bad files, and the shipped files' entries fit their kernels."""

from __future__ import annotations

import json

import pytest
import torch

from skyline.ops import activation, norm, rotary, tuning
from skyline.ops.tuning import (
    CONFIG_DIR,
    KernelConfigError,
    get_config,
    read_configs,
    token_bucket,
    write_configs,
)

DEFAULT = {"BLOCK": 1024, "num_warps": 4}


@pytest.fixture
def on_gpu(tmp_path, monkeypatch):
    """get_config reading from tmp_path, as if running on a GPU named "Test GPU"."""
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_current_device_name", lambda: "Test GPU")
    tuning._tables.cache_clear()
    yield tmp_path
    tuning._tables.cache_clear()


def test_token_bucket():
    assert [token_bucket(n) for n in (1, 2, 4, 5, 64, 65, 16384, 10**6)] == [
        1, 4, 4, 16, 64, 256, 16384, 16384]


def test_lookup_falls_back_to_default(on_gpu):
    assert get_config("silu_and_mul", "d14336:bf16:t1", DEFAULT) == DEFAULT


def test_written_configs_are_found_and_merged(on_gpu):
    path = on_gpu / "test.json"
    write_configs(path, "Test GPU", {"silu_and_mul": {"d8:bf16:t1": {"BLOCK": 256}}},
                  meta={"command": "first"})
    write_configs(path, "Test GPU", {"silu_and_mul": {"d8:bf16:t4": {"BLOCK": 512,
                                                                    "num_warps": 8}},
                                     "gemv": {"k": {"BLOCK_N": 16}}})
    # fields a stored entry lacks keep their default; earlier entries and meta survive a merge
    assert get_config("silu_and_mul", "d8:bf16:t1", DEFAULT) == {"BLOCK": 256, "num_warps": 4}
    assert get_config("silu_and_mul", "d8:bf16:t4", DEFAULT) == {"BLOCK": 512, "num_warps": 8}
    assert get_config("gemv", "k", {}) == {"BLOCK_N": 16}
    assert read_configs(path)["meta"] == {"command": "first"}
    # another GPU's file in the same folder is not used
    write_configs(on_gpu / "other.json", "Other GPU",
                  {"silu_and_mul": {"d8:bf16:t1": {"BLOCK": 2}}})
    assert get_config("silu_and_mul", "d8:bf16:t1", DEFAULT)["BLOCK"] == 256


def test_no_gpu_means_defaults(tmp_path, monkeypatch):
    write_configs(tmp_path / "x.json", "Test GPU", {"k": {"key": {"BLOCK": 2}}})
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_current_device_name", lambda: None)
    tuning._tables.cache_clear()
    assert get_config("k", "key", DEFAULT) == DEFAULT
    tuning._tables.cache_clear()


def test_writing_another_devices_file_is_refused(tmp_path):
    write_configs(tmp_path / "a.json", "GPU A", {"k": {"key": {"BLOCK": 2}}})
    with pytest.raises(KernelConfigError, match="holds configs for 'GPU A'"):
        write_configs(tmp_path / "a.json", "GPU B", {"k": {"key": {"BLOCK": 4}}})


@pytest.mark.parametrize("text", ["{not json", json.dumps({"configs": {}}),
                                  json.dumps({"device": "Test GPU", "configs": {"k": [1]}})])
def test_bad_file_gives_one_clear_error(on_gpu, text):
    (on_gpu / "bad.json").write_text(text)
    with pytest.raises(KernelConfigError, match="run bench/kernels/tune_kernels.py again"):
        get_config("k", "key", DEFAULT)


def test_dispatchers_find_tuned_entries_under_their_keys(on_gpu):
    # The keys the tuner writes (each module's config_key) are the ones the dispatchers read.
    tuned = {"BLOCK_M": 2, "num_warps": 8}
    write_configs(on_gpu / "t.json", "Test GPU", {
        "fused_add_rms_norm": {norm.config_key(4096, torch.bfloat16, 3): tuned},
        "qk_norm_rotary": {rotary.config_key(32, 8, 128, torch.bfloat16, 3): {"BLOCK_H": 2}},
        "silu_and_mul": {activation.config_key(14336, torch.bfloat16, 3): {"BLOCK": 512}},
    })
    for cached in (norm._config, rotary._config, activation._config):
        cached.cache_clear()
    try:
        bucket = token_bucket(3)
        assert norm._config("fused_add_rms_norm", 4096, torch.bfloat16, bucket) == tuned
        assert norm._config("rms_norm", 4096, torch.bfloat16, bucket) == norm.default_config(
            4096, bucket)
        assert rotary._config("qk_norm_rotary", 32, 8, 128, torch.bfloat16, bucket)["BLOCK_H"] == 2
        assert activation._config(14336, torch.bfloat16, bucket)["BLOCK"] == 512
    finally:
        for cached in (norm._config, rotary._config, activation._config):
            cached.cache_clear()


def test_shipped_configs_fit_their_kernels():
    # Every shipped entry of the kernels in this package has exactly the fields its dispatcher
    # reads, with positive power-of-two values (a block size or a warp count).
    fields = {
        "rms_norm": {"BLOCK_M", "num_warps"},
        "fused_add_rms_norm": {"BLOCK_M", "num_warps"},
        "rotary": {"BLOCK_H", "num_warps"},
        "qk_norm_rotary": {"BLOCK_H", "num_warps"},
        "silu_and_mul": {"BLOCK", "num_warps"},
    }
    for path in sorted(CONFIG_DIR.glob("*.json")):
        data = read_configs(path)
        for kernel, table in data["configs"].items():
            for key, config in table.items():
                if kernel in fields:
                    assert set(config) == fields[kernel], (path.name, kernel, key)
                    assert all(v > 0 and v & (v - 1) == 0 for v in config.values()), (
                        path.name, kernel, key)
