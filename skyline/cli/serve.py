"""`skyline serve` (one replica, a fleet behind the router, or Ray Serve), `skyline router` and
`skyline worker` (a parallel model's ranks on another host)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from skyline.cli.args import (
    engine_args,
    router_config,
    strip_flags,
)
from skyline.config import ConfigError


def _replica_flags(ns: argparse.Namespace) -> tuple[list[list[str]], bool]:
    """Per replica of `serve --replicas N`: its device, CPU threads, GPU memory share and
    role flags; and whether they must start one after the other (several on one GPU)."""
    from skyline.engine.create import resolve_device

    n = ns.replicas
    roles = ns.role.split(",")
    if len(roles) not in (1, n):
        raise ConfigError(f"--role takes one role or one per replica ({n}), got {ns.role!r}")
    roles = roles * n if len(roles) == 1 else roles
    device = resolve_device(ns.device)
    flags: list[list[str]] = [["--role", role] for role in roles]
    if device == "cpu":
        threads = ns.threads or max(1, (os.cpu_count() or 1) // n)
        for f in flags:
            f += ["--device", "cpu", "--threads", str(threads)]
        return flags, False
    import torch

    gpus = [int(device.split(":")[1])] if ":" in device else list(range(torch.cuda.device_count()))
    per_gpu: dict[int, int] = {}
    for i in range(n):
        g = gpus[i % len(gpus)]
        per_gpu[g] = per_gpu.get(g, 0) + 1
    seen: dict[int, int] = {}
    for i, f in enumerate(flags):
        g = gpus[i % len(gpus)]
        seen[g] = seen.get(g, 0) + 1
        # The j-th of k replicas on a GPU may use j/k of --gpu-memory-utilization: each sizes
        # its cache from what is free, so they start in turn and share it evenly.
        share = ns.gpu_memory_utilization * seen[g] / per_gpu[g]
        f += ["--device", f"cuda:{g}", "--gpu-memory-utilization", f"{share:.4f}"]
    return flags, max(per_gpu.values()) > 1


def _serve_fleet(ns: argparse.Namespace, api_key: str | None) -> None:
    """`skyline serve --replicas N` (or --ray): N engines and a router in front."""
    from skyline.engine.frontend.prompt_hash import PromptHasher
    from skyline.router.app import serve as serve_router
    from skyline.router.fleet import Fleet
    from skyline.router.launch import LocalReplicas

    if ns.replicas < 1:
        raise ConfigError("--replicas must be at least 1")
    argv = ns.argv[ns.argv.index("serve") + 1:]
    base = strip_flags(argv)
    if ns.ray:
        return _serve_ray(ns, base, api_key)
    flags, sequential = _replica_flags(ns)
    # The router's port is held (bound, refusing connections) while the replicas start: a port in
    # use fails now, and no replica can be given it.
    sock = _router_socket(ns, listen=False)
    local = LocalReplicas([base + f for f in flags], sequential=sequential,
                          reserved=(sock.getsockname()[1],))
    print(f"skyline: starting {ns.replicas} replicas ...", flush=True)
    try:
        local.start()
        fleet = Fleet(router_config(ns, local.urls, api_key), PromptHasher(ns.model))
        serve_router(fleet, sock, ns.uvicorn_log_level,
                     on_stop=lambda: local.stop(ns.shutdown_timeout))
    except RuntimeError as e:
        sys.exit(f"skyline: error: {e}")
    finally:
        local.stop(ns.shutdown_timeout)  # done already unless the router failed to start


def _router_socket(ns: argparse.Namespace, listen: bool = True) -> socket.socket:
    """The router's socket on --host:--port (a port in use: the server's one-line error)."""
    from skyline.server.launch import bind_socket

    try:
        return bind_socket(ns.host, ns.port, listen=listen)
    except OSError as e:
        raise ConfigError(str(e)) from None


def _serve_ray(ns: argparse.Namespace, base: list[str], api_key: str | None) -> None:
    """`skyline serve --ray`: the replicas (a Serve deployment per role) and the router on
    Ray Serve; Ray gives each replica its GPUs (--ray-num-gpus) and CPUs (--threads)."""
    import signal
    import threading

    from skyline.deploy.ray import deploy_from_cli
    from skyline.engine.create import resolve_device

    roles = ns.role.split(",")
    if len(roles) not in (1, ns.replicas):
        raise ConfigError(f"--role takes one role or one per replica ({ns.replicas}), got "
                          f"{ns.role!r}")
    counts: dict[str, int] = {}
    for role in roles * ns.replicas if len(roles) == 1 else roles:
        counts[role] = counts.get(role, 0) + 1
    on_gpu = ns.device.startswith("cuda") or (ns.device == "auto" and ns.ray_num_gpus)
    device = "cuda" if on_gpu else resolve_device(ns.device).split(":")[0]
    num_gpus = ns.ray_num_gpus if ns.ray_num_gpus is not None else float(device == "cuda")
    threads = ns.threads or 1
    argv = [*base, "--device", device, "--threads", str(threads)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def wait() -> None:
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass

    deploy_from_cli(argv, counts, router_config(ns, ["ray"], api_key), ns.model, ns.host,
                    ns.port, num_gpus, float(threads), ns.ray_address, wait)


def cmd_router(ns: argparse.Namespace) -> None:
    from skyline.engine.frontend.prompt_hash import PromptHasher
    from skyline.router.app import serve as serve_router
    from skyline.router.fleet import Fleet

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("skyline.router").setLevel(logging.INFO)
    from skyline import envs

    cfg = router_config(ns, ns.replica, ns.api_key or envs.ENV.api_key)
    serve_router(Fleet(cfg, PromptHasher(ns.model)), _router_socket(ns), ns.uvicorn_log_level)


def cmd_serve(ns: argparse.Namespace) -> None:
    from skyline import envs
    from skyline.engine.process import EngineStartError
    from skyline.engine.supervisor import EngineDeadError, RestartPolicy
    from skyline.router.launch import free_port, free_port_pair
    from skyline.server.launch import serve
    from skyline.server.limits import RequestLimits

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("skyline.server").setLevel(logging.INFO)  # request ids in the log
        logging.getLogger("skyline.router").setLevel(logging.INFO)
    if ns.model_tag is not None and ns.model is None:
        ns.model = ns.model_tag
    api_key = serve_api_key(ns.api_key, ns.api_key_file, envs.ENV.api_key)
    if ns.replicas != 1 or ns.ray:
        if ns.api_server_count != 1:
            raise ConfigError("--api-server-count works with one replica; leave it out with "
                              "--replicas or --ray (the router spreads requests over replicas)")
        return _serve_fleet(ns, api_key)
    if ns.kv_events_port == 0:
        ns.kv_events_host = "127.0.0.1" if ns.host in ("127.0.0.1", "localhost") else ns.host
        ns.kv_events_port = free_port_pair(ns.kv_events_host, frozenset({ns.port}))
    elif ns.kv_events_port is not None or ns.role != "both":
        ns.kv_events_host = ns.host
    if ns.role == "prefill" and ns.kv_transfer_port is None:
        # chosen once here, so that a restarted engine keeps it (routers read it at join)
        events = (ns.kv_events_port, ns.kv_events_port + 1) if ns.kv_events_port else ()
        ns.kv_transfer_port = free_port(ns.kv_events_host, frozenset({ns.port, *events}))
    chat_template = None
    if ns.chat_template is not None:
        try:
            with open(ns.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --chat-template {ns.chat_template} ({e})") from None
    limits = RequestLimits(
        max_body_bytes=ns.max_request_bytes, max_prompt_chars=ns.max_prompt_chars,
        max_n=ns.max_n, max_stop=ns.max_stop, max_stop_chars=ns.max_stop_chars,
        max_logprobs=ns.max_logprobs, max_tools=ns.max_tools,
        max_schema_bytes=ns.max_schema_bytes, max_logit_bias=ns.max_logit_bias,
        prepare_timeout_s=ns.prepare_timeout, body_timeout_s=ns.body_timeout)
    args = engine_args(ns, served_model_name=ns.served_model_name)
    try:
        serve(args, host=ns.host, port=ns.port, api_key=api_key, limits=limits,
              shutdown_timeout=ns.shutdown_timeout, log_level=ns.uvicorn_log_level,
              restart=RestartPolicy(max_restarts=ns.max_engine_restarts),
              max_waiting=ns.max_waiting, chat_template=chat_template,
              parse_workers=ns.parse_workers, tool_call_parser=ns.tool_call_parser,
              api_server_count=ns.api_server_count)
    except (EngineStartError, EngineDeadError, OSError) as e:
        sys.exit(f"skyline: error: {e}")


def cmd_worker(ns: argparse.Namespace) -> None:
    from skyline.worker.executor.spawn import run_node

    sys.exit(run_node(ns.distributed_init, ns.node_rank, ns.nnodes))


def serve_api_key(flag: str | None, path: str | None, env: str | None) -> str | None:
    """The API key: --api-key-file, else --api-key (with a warning: any user can read a
    command line, e.g. in `ps`), else $SKYLINE_API_KEY."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --api-key-file {path} ({e})") from None
        if not key:
            raise ConfigError(f"--api-key-file {path} is empty; put the key in it")
        return key
    if flag is not None:
        print("skyline: warning: --api-key is visible to every user of this machine (e.g. in "
              "ps); prefer --api-key-file or $SKYLINE_API_KEY", file=sys.stderr)
        return flag
    return env or None
