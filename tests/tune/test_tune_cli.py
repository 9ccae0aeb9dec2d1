"""`skyline tune` through the CLI on the CPU: the smoke run measures, ranks, tunes the CPU plan,
re-measures and reports in a few seconds (its figures are not asserted); a cache folder it
cannot write or a bad cache file stops it with one sentence before any measuring."""

from __future__ import annotations

import json

import pytest
import torch

from skyline import cli, envs
from skyline.bench.smoke import tiny_model
from skyline.ops import cpu_plan, tuning


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    monkeypatch.setattr(envs, "ENV", envs.ENV)  # the smoke run points it at a temporary cache
    threads = torch.get_num_threads()
    tuning.reload()
    yield
    torch.set_num_threads(threads)  # an engine built from a tuned plan sets torch's threads
    tuning.reload()


def test_smoke_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "tune.json"
    users = envs.ENV.kernel_cache_dir
    cli.main(["tune", "--smoke", "--out", str(out), "-q"])
    printed = capsys.readouterr().out
    assert "family" in printed and "end to end" in printed
    r = json.loads(out.read_text())
    assert r["device"] == tuning.cpu_device_name() and r["command"].startswith("skyline tune")
    assert {"date", "machine", "ranking", "rounds", "phase_s", "matmul_peak_TFLOPs",
            "copy_bandwidth_TBps"} <= set(r)
    assert set(r["phase_s"]) == {"prefill", "decode_1", "decode_batch"}
    fams = {row["family"]: row for row in r["ranking"]}
    assert fams["linear"]["tuner"] == "cpu_linear" and 0 < fams["linear"]["s"]
    [rnd] = r["rounds"]
    assert rnd["family"] == "linear" and isinstance(rnd["kept"], bool)
    entry = rnd["configs"]["cpu_plan"]
    assert list(entry) == [cpu_plan.family(cpu_plan.probe())]
    assert "threads" in next(iter(entry.values()))
    # the table in the cache is the round's if kept, else none
    stored = r["cache"].get("cpu_plan")
    assert (stored == entry) if rnd["kept"] else stored is None
    # a smoke run leaves the user's cache alone
    assert "skyline-tune-smoke-" in r["cache_file"] and not r["cache_file"].startswith(users)


def small(cache: str) -> list[str]:
    return ["tune", "--model", tiny_model(), "--load-format", "dummy", "--device", "cpu",
            "--batch", "2", "--context", "8", "--prefill-len", "8", "--decode-steps", "2",
            "--reps", "1", "--kv-cache-memory", "16MiB", "-q"]


def test_unwritable_cache_is_one_sentence(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SKYLINE_KERNEL_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    with pytest.raises(SystemExit) as e:
        cli.main(small(str(blocker)))
    msg = str(e.value.code)
    assert msg.startswith("skyline: error: cannot write kernel configs to ")
    assert "SKYLINE_KERNEL_CACHE" in msg and "\n" not in msg
    assert "end to end" not in capsys.readouterr().out  # stopped before measuring


def test_bad_cache_file_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYLINE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    tuning.user_config_path(tuning.cpu_device_name()).write_text("{broken")
    with pytest.raises(SystemExit) as e:
        cli.main(small(str(tmp_path)))
    msg = str(e.value.code)
    assert "cannot read kernel configs" in msg and "run `skyline tune` again" in msg
    assert "\n" not in msg


def test_parallel_flags_are_refused():
    with pytest.raises(SystemExit) as e:
        cli.main([*small(""), "--tensor-parallel-size", "2"])
    assert "measures one device" in str(e.value.code)


def test_an_engine_error_in_the_measuring_process_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYLINE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    with pytest.raises(SystemExit) as e:
        cli.main([*small(""), "--block-size", "3"])
    msg = str(e.value.code)
    assert msg.startswith("skyline: error: --block-size must be a power of two")
    assert "\n" not in msg
