"""`skyline serve --replicas N` / `--ray`: what each replica is started with, without starting
any (the launcher and the Ray deployment are replaced by recorders)."""

from __future__ import annotations

from typing import Any

import pytest

from skyline import cli
from skyline.cli.args import strip_flags
from skyline.config import ConfigError


def test_strip_flags():
    argv = ["--model", "m", "--replicas", "2", "--port=9", "--ray", "--policy", "round-robin",
            "--threads", "3", "--max-num-seqs", "4"]
    assert strip_flags(argv) == ["--model", "m", "--max-num-seqs", "4"]


def test_ray_gets_one_deployment_per_role(monkeypatch: pytest.MonkeyPatch):
    import skyline.deploy.ray as ray_deploy

    seen: dict[str, Any] = {}

    def record(argv, roles, cfg, model, host, port, num_gpus, num_cpus, address, wait) -> None:
        seen.update(argv=argv, roles=roles, policy=cfg.policy, port=port, num_gpus=num_gpus,
                    num_cpus=num_cpus)

    monkeypatch.setattr(ray_deploy, "deploy_from_cli", record)
    cli.main(["serve", "--ray", "--replicas", "3", "--role", "prefill,decode,decode",
              "--device", "cpu", "--port", "9", "--policy", "least-load",
              "--max-num-seqs", "4", "--threads", "2"])
    assert seen["roles"] == {"prefill": 1, "decode": 2}
    assert seen["argv"] == ["--max-num-seqs", "4", "--device", "cpu", "--threads", "2"]
    assert (seen["policy"], seen["port"], seen["num_gpus"], seen["num_cpus"]) == (
        "least-load", 9, 0.0, 2.0)


def test_local_replicas_split_the_cpu(monkeypatch: pytest.MonkeyPatch):
    import skyline.router.launch as launch

    started: list[list[str]] = []

    reserved_ports: list[tuple[int, ...]] = []

    class Recorder:
        def __init__(self, argvs: list[list[str]], sequential: bool = False,
                     reserved: tuple[int, ...] = ()) -> None:
            started.extend(argvs)
            reserved_ports.append(reserved)
            self.urls = ["http://127.0.0.1:1"]

        def start(self) -> None:
            raise RuntimeError("stop here")

        def stop(self, timeout: float = 0) -> None:
            pass

    monkeypatch.setattr(launch, "LocalReplicas", Recorder)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 4)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--replicas", "2", "--role", "prefill,decode", "--device", "cpu",
                  "--max-num-seqs", "4", "--port", "0"])
    # the router's port, held while the replicas start, is one no replica may be given
    assert len(reserved_ports) == 1 and reserved_ports[0][0] > 0
    assert started == [["--max-num-seqs", "4", "--role", "prefill", "--device", "cpu",
                        "--threads", "2"],
                       ["--max-num-seqs", "4", "--role", "decode", "--device", "cpu",
                        "--threads", "2"]]
    with pytest.raises(SystemExit, match="one role or one per replica"):
        cli.main(["serve", "--replicas", "2", "--role", "a,b,c", "--device", "cpu"])


def test_router_port_in_use_fails_before_any_replica_starts(monkeypatch: pytest.MonkeyPatch):
    import socket

    import skyline.router.launch as launch

    def never(*a: Any, **k: Any) -> None:
        raise AssertionError("a replica was set up although the router cannot listen")

    monkeypatch.setattr(launch, "LocalReplicas", never)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}.*--port"):
            cli.main(["serve", "--replicas", "2", "--device", "cpu", "--port", str(port)])


def test_bad_role_is_one_sentence():
    from skyline.config import FleetConfig

    with pytest.raises(ConfigError, match="--role must be one of"):
        FleetConfig(role="decoder")
