"""Every flag has help with its default; a bad value is one line naming the flag, not a
traceback or the whole usage block."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from skyline.cli import build_parser
from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.server.launch import bind_socket


def _options(parser: argparse.ArgumentParser, name: str = "skyline"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _options(p, f"{name} {sub}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_flag_has_help_that_gives_its_default():
    missing = []
    for name, a in _options(build_parser()):
        text = a.help or ""
        silent = a.default is None and a.nargs != 0 and not a.required and "default" not in text
        if not text or silent:
            missing.append(f"{name} {a.option_strings[0]}")
    assert not missing, missing
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--port PORT" in text and "(default: 8000)" in text


def _commands(parser: argparse.ArgumentParser, name: str = "skyline"):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield name, parser
    for action in subs:
        for sub, p in action.choices.items():
            yield from _commands(p, f"{name} {sub}")


def test_every_command_takes_quiet():
    """main() reads --quiet of whatever command ran: one without it crashed before starting."""
    assert [n for n, p in _commands(build_parser())
            if "quiet" not in {a.dest for a in p._actions}] == []


@pytest.mark.parametrize("argv, line", [
    ("serve --port 99999", "skyline serve: error: --port must be in 0..65535, got 99999"),
    ("router --port 0", "skyline router: error: --port must be in 1..65535, got 0"),
    ("serve --port http", "skyline serve: error: --port must be a whole number, got 'http'"),
    ("serve --host 256.1.1.1", "skyline serve: error: --host must be an IP address"),
    ("serve --host bad_name!", "skyline serve: error: --host must be an IP address"),
    ("generate hi --max-model-len 0", "--max-model-len must be at least 1, got 0"),
    ("chat --max-num-seqs 0", "--max-num-seqs must be at least 1, got 0"),
    ("chat --max-num-seqs many", "--max-num-seqs must be a whole number, got 'many'"),
    ("serve --max-num-batched-tokens -5", "--max-num-batched-tokens must be at least 1, got -5"),
    ("serve --gpu-memory-utilization 1.5", "--gpu-memory-utilization must be in (0, 1]"),
    ("serve --kv-cache-memory lots", "--kv-cache-memory: cannot read 'lots' as a size"),
    ("generate hi --load-format foo", "--load-format: invalid choice: 'foo'"),
    ("generate hi --top-p 0", "--top-p must be in (0, 1], got 0"),
    ("bench offline --num-prompts 0", "--num-prompts must be at least 1, got 0"),
    ("bench offline --top-p 0", "--top-p must be in (0, 1], got 0"),
    ("bench serve --top-p 1.5", "--top-p must be in (0, 1], got 1.5"),
    ("serve -tp 0", "--tensor-parallel-size must be at least 1, got 0"),
    ("serve --distributed-timeout 0", "--distributed-timeout must be"),
    ("worker --distributed-init tcp://h:1 --node-rank 0", "--node-rank must be at least 1"),
    ("serve --api-server-count 0", "--api-server-count must be in 1..64, got 0"),
    ("serve --api-server-count -1", "--api-server-count must be in 1..64, got -1"),
    ("serve --api-server-count abc", "--api-server-count must be a whole number, got 'abc'"),
    ("serve --api-server-count 10000", "--api-server-count must be in 1..64, got 10000"),
    ("serve --n-cpu-moe -1", "--n-cpu-moe must be at least 0, got -1"),
    ("tune --budget-s 0", "skyline tune: error: --budget-s must be above 0, got 0"),
    ("tune --budget-s -3", "--budget-s must be above 0, got -3"),
    ("tune --budget-s nan", "--budget-s must be above 0, got nan"),
    ("tune --budget-s inf", "--budget-s must be a finite number, got inf"),
    ("serve --shutdown-timeout inf", "--shutdown-timeout must be a finite number, got inf"),
    ("tune --rounds 0", "--rounds must be at least 1, got 0"),
    ("tune --rounds x", "--rounds must be a whole number, got 'x'"),
])
def test_bad_value_is_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv.split())
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and line in err and "--help" in err, err


def test_good_values_parse():
    ns = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "65535",
                                    "--max-model-len", "1", "--gpu-memory-utilization", "1"])
    assert (ns.host, ns.port, ns.max_model_len) == ("0.0.0.0", 65535, 1)
    for h in ("::", "localhost", "node-1.example.com", "fe80::1"):
        assert build_parser().parse_args(["router", "--host", h]).host == h


def test_the_command_prints_one_line_and_no_usage():
    r = subprocess.run([sys.executable, "-m", "skyline.cli", "serve", "--port", "99999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("skyline serve: error: --port must be in 0..65535, got 99999 "
                        "(see 'skyline serve --help')\n")


def test_api_counts_below_one_are_refused():
    with pytest.raises(ConfigError, match="--max-model-len must be at least 1, got 0"):
        create_engine_config(EngineArgs(max_model_len=0, device="cpu"))
    with pytest.raises(ConfigError, match="--max-num-seqs must be at least 1"):
        create_engine_config(EngineArgs(max_num_seqs=0, device="cpu"))


def test_host_not_of_this_machine_says_so_not_pick_a_port():
    with pytest.raises(OSError) as e:
        bind_socket("203.0.113.7", 8123)  # TEST-NET-3: never a local address
    assert "--host must be an address of this machine" in str(e.value)
    assert "--port" not in str(e.value)


def test_unknown_flag_is_reported_by_its_command_with_the_closest_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--max-model-length", "5"])
    assert capsys.readouterr().err == (
        "skyline generate: error: unrecognized arguments: --max-model-length 5; did you mean "
        "--max-model-len? (see 'skyline generate --help')\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "offline", "--zzz"])
    assert capsys.readouterr().err.startswith(
        "skyline bench offline: error: unrecognized arguments: --zzz (see")


@pytest.mark.parametrize("kw, line", [
    (dict(expert_parallel=True), "--expert-parallel places the experts of a mixture-of-experts "
                                 "model, and SmolLM2"),
    (dict(expert_parallel=True, tensor_parallel_size=2), "has none; drop --expert-parallel"),
    (dict(n_cpu_moe=999), "--n-cpu-moe 999 places the experts of a mixture-of-experts model"),
])
def test_moe_flags_on_a_dense_model_are_refused_not_ignored(kw, line):
    with pytest.raises(ConfigError) as e:
        create_engine_config(EngineArgs(device="cpu", **kw))
    assert line in str(e.value) and "\n" not in str(e.value)


def _tune_spec(out=None, **workload):
    from skyline.tune.loop import LoopSpec
    from skyline.tune.run import TuneSpec
    from skyline.tune.workload import Workload

    wl = {"prefill_len": 8, "batch": 1, "context": 8, "decode_steps": 1, "reps": 1, **workload}
    return TuneSpec(Workload(**wl), LoopSpec(rounds=1, budget_s=1.0, min_gain=0.0), out, True,
                    "tune")


@pytest.mark.parametrize("args, workload, line", [
    ({}, {"context": 10**8}, "need 100000017 tokens of context, and the model allows 8192"),
    ({"max_model_len": 64}, {"prefill_len": 100}, "and --max-model-len allows 64; lower them"),
    ({}, {"batch": 100000}, "--batch 100000 is more sequences than the engine runs at once"),
])
def test_tune_refuses_a_workload_that_cannot_run_before_measuring(args, workload, line):
    """A context of 10^8 built its prompts for minutes before anything was measured."""
    from skyline.tune.run import run_tune

    with pytest.raises(ConfigError, match=line):
        run_tune(EngineArgs(device="cpu", **args), _tune_spec(**workload))


def test_tune_refuses_an_unwritable_out_before_measuring(tmp_path):
    from skyline.tune.run import run_tune

    def spec(out):
        return _tune_spec(out)

    blocker = tmp_path / "file"
    blocker.write_text("")
    for out, line in [(str(blocker / "r.json"), "cannot write the report to --out"),
                      (str(tmp_path), "is a folder; give a file name")]:
        with pytest.raises(ConfigError, match=line):  # before any engine starts: milliseconds
            run_tune(EngineArgs(device="cpu"), spec(out))
    assert blocker.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
