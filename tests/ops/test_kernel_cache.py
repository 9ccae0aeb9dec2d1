"""The per-device user cache of tuned configs (`skyline tune`): read after the shipped tables,
so a user's entry overrides a shipped one on their device only; the CPU plan reads its own
entry over the family's defaults; a bad or unwritable cache gives one sentence."""

from __future__ import annotations

import os

import pytest
import torch

from skyline import envs
from skyline.ops import cpu_plan, tuning
from skyline.ops.tuning import KernelConfigError, get_config, write_configs

AVX2 = cpu_plan.CpuCaps("AVX2", avx512_bf16=False, amx_bf16=False, onednn_bf16=False)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(shipped folder, user cache folder), both empty, on a GPU named "Test GPU"."""
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir()
    monkeypatch.setattr(tuning, "CONFIG_DIR", shipped)
    monkeypatch.setenv("SKYLINE_KERNEL_CACHE", str(user))
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    monkeypatch.setattr(tuning, "_current_device_name", lambda: "Test GPU")
    tuning.reload()
    yield shipped, user
    tuning.reload()


def test_default_cache_folder_follows_xdg(monkeypatch):
    monkeypatch.delenv("SKYLINE_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert envs.Env.read().kernel_cache_dir == os.path.join("/x/cache", "skyline", "kernels")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.Env.read().kernel_cache_dir.endswith(os.path.join(".cache", "skyline", "kernels"))


def test_user_entry_overrides_shipped_on_its_device_only(dirs):
    shipped, _ = dirs
    write_configs(shipped / "gemv-test.json", "Test GPU",
                  {"gemv": {"a": {"BLOCK_N": 16, "num_warps": 4}, "b": {"BLOCK_N": 8}}})
    assert get_config("gemv", "a", {})["BLOCK_N"] == 16
    write_configs(tuning.user_config_path("Test GPU"), "Test GPU",
                  {"gemv": {"a": {"BLOCK_N": 32}}})
    write_configs(tuning.user_config_path("Other GPU"), "Other GPU",
                  {"gemv": {"b": {"BLOCK_N": 64}}})
    assert tuning.user_config_path("Test GPU").name == "test-gpu.json"
    # the user's entry wins (whole entry over the default; the shipped one is replaced), the
    # shipped entries the user did not tune stay, another device's file is not read
    assert get_config("gemv", "a", {"num_warps": 2}) == {"num_warps": 2, "BLOCK_N": 32}
    assert get_config("gemv", "b", {}) == {"BLOCK_N": 8}
    assert get_config("gemv", "b", {}, device="Other GPU") == {"BLOCK_N": 64}


def test_bad_user_file_gives_one_sentence(dirs):
    _, user = dirs
    user.mkdir()
    (user / "test-gpu.json").write_text("{oops")
    with pytest.raises(KernelConfigError, match=r"test-gpu.json .*run `skyline tune` again"):
        get_config("gemv", "a", {})


def test_unwritable_cache_gives_one_sentence(dirs, monkeypatch):
    blocker = dirs[0].parent / "file"
    blocker.write_text("")
    monkeypatch.setenv("SKYLINE_KERNEL_CACHE", str(blocker / "sub"))
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    with pytest.raises(KernelConfigError, match="set SKYLINE_KERNEL_CACHE to a folder"):
        write_configs(tuning.user_config_path("Test GPU"), "Test GPU", {"k": {"a": {"X": 1}}})


def test_cpu_plan_reads_its_tuned_entry(dirs, monkeypatch):
    monkeypatch.setattr(cpu_plan, "probe", lambda: AVX2)
    default = cpu_plan.plan()
    assert default.threads is None and default.dtype == torch.float32
    cpu = tuning.cpu_device_name()
    assert cpu.startswith("cpu: ")
    write_configs(tuning.user_config_path(cpu), cpu, {"cpu_plan": {
        "avx2": {"int4_rows": 2, "threads": 3, "dtype": "bf16"},
        "avx512": {"int4_rows": 16}}})
    tuned = cpu_plan.plan()
    assert tuned.threads == 3 and tuned.dtype == torch.bfloat16
    assert tuned.int4_rows == (2 if cpu_int4_kernel() else 0)
    assert tuned.int4_wide_rows == default.int4_wide_rows
    # another family's entry (ATEN_CPU_CAPABILITY lowered) is its own
    write_configs(tuning.user_config_path(cpu), cpu, {"cpu_plan": {"avx2": {"threads": -1}}})
    with pytest.raises(KernelConfigError, match="threads is -1, not a whole number"):
        cpu_plan.plan()
    # the integer dot kernel's rounding count: 1 or 2
    write_configs(tuning.user_config_path(cpu), cpu, {"cpu_plan": {"avx2": {"intdot_rounds": 2}}})
    assert cpu_plan.plan().intdot_rounds == 2
    write_configs(tuning.user_config_path(cpu), cpu, {"cpu_plan": {"avx2": {"intdot_rounds": 3}}})
    with pytest.raises(KernelConfigError, match="intdot_rounds is 3, not 1 or 2"):
        cpu_plan.plan()


def cpu_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
