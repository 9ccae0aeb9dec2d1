"""The one argparse: `skyline serve | generate | chat | bench | frontier ...`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from skyline import progress
from skyline.cli_args import (  # noqa: F401  (engine_args: used by bench scripts and tests)
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    Parser,
    add_engine_args,
    add_load_args,
    add_quiet,
    add_router_args,
    add_sampling_args,
    add_tune_args,
    engine_args,
    float_in,
    host,
    int_in,
    load_specs,
    port_range,
    router_config,
    sampling_params,
    strip_flags,
)
from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.server.tool_parsers import PARSERS


def _cmd_generate(ns: argparse.Namespace) -> None:
    from skyline.engine.frontend.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args(ns)))
    params = sampling_params(ns)
    prompt: str | list[int] = ns.prompt
    if not ns.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompt = llm.render_chat([{"role": "user", "content": ns.prompt}])
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _cmd_chat(ns: argparse.Namespace) -> None:
    from skyline.engine.frontend.llm import LLM
    from skyline.tools.chat import run_chat

    run_chat(LLM(**dataclasses.asdict(engine_args(ns))), sampling_params(ns), ns.system)


def _cmd_bench_offline(ns: argparse.Namespace) -> None:
    from skyline.bench.offline import run_offline

    run_offline(engine_args(ns), ns.num_prompts, ns.input_len, ns.output_len, ns.output,
                floor=ns.floor)


def _cmd_bench_serve(ns: argparse.Namespace) -> None:
    import dataclasses as dc
    import os

    from skyline.bench.serve import run_serve_bench

    load, workload, slos = load_specs(ns)
    load = dc.replace(load, base_url=ns.base_url, model=ns.model, concurrency=ns.concurrency,
                      request_rate=ns.request_rate, temperature=ns.temperature,
                      api_key=ns.api_key or os.environ.get("OPENAI_API_KEY"),
                      progress=not (ns.no_progress or ns.quiet))
    run_serve_bench(load, workload, slos, ns.output)


def _cmd_frontier(ns: argparse.Namespace) -> None:
    from skyline.bench.frontier import FrontierSpec, run_frontier

    load, workload, slos = load_specs(ns)
    parser = build_parser()

    def parse_flags(flags: list[str]) -> EngineArgs:
        import contextlib
        import io

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                return engine_args(parser.parse_args(["serve", *flags]))
        except SystemExit:
            raise ConfigError(f"skyline serve does not accept {' '.join(flags)}; check "
                              "--grid and --base-flags against 'skyline serve --help'") from None

    spec = FrontierSpec(grid=ns.grid or [], base_flags=ns.base_flags, concurrency=ns.concurrency,
                        output_dir=ns.output_dir, quality=ns.quality,
                        reference_flags=ns.reference_flags, calib_tokens=ns.calib_tokens,
                        num_gpus=ns.num_gpus, percentile=ns.percentile,
                        startup_timeout=ns.startup_timeout, ports=ns.port)
    run_frontier(spec, load, workload, slos, parse_flags, dry_run=ns.dry_run)


def _cmd_tune(ns: argparse.Namespace) -> None:
    from skyline.engine.create import resolve_device
    from skyline.tune.loop import LoopSpec
    from skyline.tune.run import TuneSpec, run_tune
    from skyline.tune.workload import Workload

    extra = {}
    sizes = {"batch": 32, "context": 1024, "prefill_len": 2048, "decode_steps": 32}
    if not ns.smoke and not resolve_device(ns.device).startswith("cuda"):
        sizes = {"batch": 8, "context": 256, "prefill_len": 512, "decode_steps": 16}
    for name, default in sizes.items():  # what the flags left out, for this device
        if getattr(ns, name) is None:
            setattr(ns, name, default)
    if ns.smoke:
        import tempfile

        from skyline import envs
        from skyline.bench.smoke import tiny_model

        # A tiny random model on the CPU, a workload of a few steps and a cache of its own (the
        # user's is left alone): the loop's code in seconds, its figures meaningless.
        envs.ENV = dataclasses.replace(
            envs.ENV, kernel_cache_dir=tempfile.mkdtemp(prefix="skyline-tune-smoke-"))
        ns.model, ns.load_format, ns.device = tiny_model(), "dummy", "cpu"
        ns.batch, ns.context, ns.prefill_len, ns.decode_steps, ns.reps = 4, 16, 32, 4, 1
        ns.rounds, ns.budget_s = 1, min(ns.budget_s, 30.0)
        extra = {"kv_cache_memory": "64MiB"}
    spec = TuneSpec(
        workload=Workload(prefill_len=ns.prefill_len, batch=ns.batch, context=ns.context,
                          decode_steps=ns.decode_steps, reps=ns.reps),
        loop=LoopSpec(rounds=ns.rounds, budget_s=ns.budget_s, min_gain=ns.min_gain),
        out=ns.out, smoke=ns.smoke, command="skyline " + " ".join(ns.argv))
    run_tune(engine_args(ns, **extra), spec)


def _cmd_quantize(ns: argparse.Namespace) -> None:
    from skyline.engine.create import create_engine_config
    from skyline.tools.quantize.checkpoint import quantize_checkpoint
    from skyline.tools.quantize.sizes import size_report

    text = None
    if ns.calib_file is not None and ns.calib_self:
        raise ConfigError("pass --calib-file or --calib-self, not both")
    if ns.calib_self:
        from skyline.engine.frontend.llm import LLM
        from skyline.tools.quantize.self_text import self_text

        calib = ns.calib_tokens or (1024 if ns.search else 4096)
        need = calib + (ns.eval_tokens if ns.search else 0)
        print(f"writing calibration text: the model's answers to built-in prompts "
              f"(~{need} tokens)", flush=True)
        text = self_text(LLM(ns.model_path), need + need // 8)  # re-tokenised text runs short
    elif ns.calib_file is not None:
        try:
            with open(ns.calib_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            msg = f"cannot read {ns.calib_file} ({e}); pass a UTF-8 text file"
            raise ConfigError(msg) from None
    if ns.search and ns.format is not None:
        raise ConfigError("pass --format (one format) or --search (a format per layer), not both")
    if ns.search and ns.budget is None:
        raise ConfigError("--search needs --budget: bits per weight (e.g. 4.5) or a size "
                          "(e.g. 70MiB)")
    if not ns.search and (ns.format is None or ns.budget is not None):
        raise ConfigError("pass --format FORMAT, or --search --budget B for a format per layer")
    cfg, _ = create_engine_config(EngineArgs(model=ns.model_path, dtype="float32", device="cpu",
                                             quantization="none"))
    if cfg.model.arch.num_experts:
        raise ConfigError("skyline quantize does not write mixture-of-experts checkpoints; serve "
                          "the model with --quantization fp8 or mxfp4 (its experts and Linears "
                          "are quantized while loading)")
    if ns.search:
        from skyline.config import DEFAULT_SEARCH_FORMATS
        from skyline.tools.quantize.report import search_checkpoint, table

        report = search_checkpoint(
            cfg.model, ns.formats or DEFAULT_SEARCH_FORMATS, ns.budget, ns.out, ns.group_size,
            calib_text=text, calib_tokens=ns.calib_tokens or 1024, eval_tokens=ns.eval_tokens,
            search_tokens=ns.search_tokens, max_evals=ns.max_evals)
        print(table(report))
        print(f"wrote {ns.out} (checkpoint, assignment.json, report.json)")
        print(size_report(ns.out, ns.model_path, "mixed formats"))
        return
    meta = quantize_checkpoint(cfg.model, ns.format, ns.out, ns.group_size, calib_text=text,
                               calib_tokens=ns.calib_tokens or 4096)
    print(f"wrote {ns.out} ({meta['format']}, calibration: {meta['calibration']['source']})")
    print(size_report(ns.out, ns.model_path, ns.format))


def _cmd_train_speculator(ns: argparse.Namespace) -> None:
    from skyline.config import TrainArgs
    from skyline.tools.speculator.train import train_speculator

    args = TrainArgs(epochs=ns.epochs, steps=ns.steps, lr=ns.lr, batch_tokens=ns.batch_tokens,
                     unroll=ns.unroll, draft_vocab=ns.draft_vocab, seed=ns.seed)
    if args.epochs < 1 or (args.steps is not None and args.steps < 1) or args.lr <= 0:
        raise ConfigError("--epochs and --steps must be at least 1 and --lr positive")
    if ns.synthesize < 0:
        raise ConfigError("--synthesize must be a number of user messages, 0 or more")
    if ns.max_tokens < 1 or args.unroll < 1 or args.draft_vocab < 1 or args.batch_tokens < 1:
        raise ConfigError("--max-tokens, --unroll, --draft-vocab and --batch-tokens must be "
                          "at least 1")
    stats = train_speculator(engine_args(ns), ns.prompts, ns.out, args, ns.num_prompts,
                             ns.max_tokens, ns.temperature, ns.synthesize,
                             command="skyline " + " ".join(sys.argv[1:]))
    v0, v1 = stats["val_before"], stats["val_after"]
    print(f"wrote {ns.out}: {stats['num_train_positions']} positions, {stats['steps']} steps; "
          f"held-out loss {v0['loss']:.3f} -> {v1['loss']:.3f}, top-1 agreement with the "
          f"target (first draft) {v0['top1_step1']:.2f} -> {v1['top1_step1']:.2f}")


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
    local = LocalReplicas([base + f for f in flags], sequential=sequential)
    print(f"skyline: starting {ns.replicas} replicas ...", flush=True)
    try:
        local.start()
        fleet = Fleet(router_config(ns, local.urls, api_key), PromptHasher(ns.model))
        serve_router(fleet, ns.host, ns.port, ns.uvicorn_log_level,
                     on_stop=lambda: local.stop(ns.shutdown_timeout))
    except RuntimeError as e:
        sys.exit(f"skyline: error: {e}")
    finally:
        local.stop(ns.shutdown_timeout)  # done already unless the router failed to start


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


def _cmd_router(ns: argparse.Namespace) -> None:
    from skyline.engine.frontend.prompt_hash import PromptHasher
    from skyline.router.app import serve as serve_router
    from skyline.router.fleet import Fleet

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("skyline.router").setLevel(logging.INFO)
    from skyline import envs

    cfg = router_config(ns, ns.replica, ns.api_key or envs.ENV.api_key)
    serve_router(Fleet(cfg, PromptHasher(ns.model)), ns.host, ns.port, ns.uvicorn_log_level)


def _cmd_serve(ns: argparse.Namespace) -> None:
    from skyline import envs
    from skyline.engine.process import EngineStartError
    from skyline.engine.supervisor import EngineDeadError, RestartPolicy
    from skyline.router.launch import free_port, free_port_pair
    from skyline.server.app import serve
    from skyline.server.limits import RequestLimits

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("skyline.server").setLevel(logging.INFO)  # request ids in the log
        logging.getLogger("skyline.router").setLevel(logging.INFO)
    if ns.model_tag is not None and ns.model is None:
        ns.model = ns.model_tag
    api_key = _serve_api_key(ns.api_key, ns.api_key_file, envs.ENV.api_key)
    if ns.replicas != 1 or ns.ray:
        if ns.api_server_count != 1:
            raise ConfigError("--api-server-count works with one replica; leave it out with "
                              "--replicas or --ray (the router spreads requests over replicas)")
        return _serve_fleet(ns, api_key)
    if ns.kv_events_port == 0:
        ns.kv_events_host = "127.0.0.1" if ns.host in ("127.0.0.1", "localhost") else ns.host
        ns.kv_events_port = free_port_pair(ns.kv_events_host)
    elif ns.kv_events_port is not None or ns.role != "both":
        ns.kv_events_host = ns.host
    if ns.role == "prefill" and ns.kv_transfer_port is None:
        # chosen once here, so that a restarted engine keeps it (routers read it at join)
        ns.kv_transfer_port = free_port(ns.kv_events_host)
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


def _cmd_worker(ns: argparse.Namespace) -> None:
    from skyline.worker.executor.multiproc import run_node

    sys.exit(run_node(ns.distributed_init, ns.node_rank, ns.nnodes))


def _serve_api_key(flag: str | None, path: str | None, env: str | None) -> str | None:
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


_UVICORN_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="skyline", description="LLM inference engine")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], type=str.upper,
                        help="how much the engine logs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    p.add_argument("prompt", help="the prompt (a user message, unless --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    add_engine_args(p)
    add_sampling_args(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--system", default=None, help="system prompt (default: none)")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    add_quiet(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    p.add_argument("--host", type=host, default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="the port to listen on (0: any free one, printed at start)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(visible in ps: prefer --api-key-file or $SKYLINE_API_KEY; default: "
                        "$SKYLINE_API_KEY, else no key)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients ask for (default: the model's file or directory "
                        "name)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template to use instead of the model's (requests cannot "
                        "bring their own; default: the model's)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="the format the model writes tool calls in (auto: the chat template's, "
                        "where it is unambiguous; ChatML templates: hermes)")
    p.add_argument("--max-waiting", type=int_in(-1), default=-1,
                   help="waiting requests beyond which new ones get 429 (-1: 4 x "
                        "--max-num-seqs; 0: no limit)")
    g = p.add_argument_group("request limits (a request over one gets a 400)")
    g.add_argument("--max-request-bytes", type=POSITIVE, default=16 << 20,
                   help="larger request bodies get 413")
    g.add_argument("--max-prompt-chars", type=NON_NEGATIVE, default=0,
                   help="characters in a prompt or a conversation (0: 32 per token of context, "
                        "at least 1Mi)")
    g.add_argument("--max-n", type=POSITIVE, default=128,
                   help="choices per request (n, times the prompts of a batched completion)")
    g.add_argument("--max-stop", type=NON_NEGATIVE, default=32,
                   help="stop strings, and stop token ids, per request")
    g.add_argument("--max-stop-chars", type=POSITIVE, default=1000,
                   help="characters per stop string")
    g.add_argument("--max-logprobs", type=NON_NEGATIVE, default=20,
                   help="top logprobs per token")
    g.add_argument("--max-tools", type=NON_NEGATIVE, default=128,
                   help="tools per request, and calls in one past assistant message")
    g.add_argument("--max-schema-bytes", type=POSITIVE, default=64 << 10,
                   help="a response_format JSON schema, a structured-output constraint, or one "
                        "tool, as JSON")
    g.add_argument("--max-logit-bias", type=NON_NEGATIVE, default=300,
                   help="tokens one logit_bias may name")
    g.add_argument("--prepare-timeout", type=float_in(0, lo_open=True), default=10.0,
                   help="seconds to parse a request, render its chat template and tokenize it")
    g.add_argument("--body-timeout", type=float_in(0, lo_open=True), default=30.0,
                   help="seconds for a request body to arrive (then 408)")
    p.add_argument("--api-server-count", type=POSITIVE, default=1,
                   help="API processes (HTTP, tokenization, detokenization) in front of the one "
                        "engine core, all on --port: more when one cannot keep up with the "
                        "engine's streams (hundreds of users on a GPU)")
    p.add_argument("--parse-workers", type=NON_NEGATIVE, default=2,
                   help="processes that parse large request bodies off the event loop")
    p.add_argument("--shutdown-timeout", type=float_in(0), default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--max-engine-restarts", type=NON_NEGATIVE, default=5,
                   help="restarts of a failed engine core allowed within ten minutes (with "
                        "backoff); one more failure stops the server, exit code 1 (0: none)")
    p.add_argument("--uvicorn-log-level", default="info", choices=_UVICORN_LEVELS,
                   help="how much the HTTP server logs")
    p.add_argument("--role", default="both",
                   help="both | prefill | decode: the work a router sends this replica (with "
                        "--replicas: one role for all, or one per replica, comma-separated)")
    p.add_argument("--kv-events-port", type=int_in(0, 65534), default=None,
                   help="publish KV events for a router on this port (ZMQ PUB; snapshots on "
                        "the next port); 0: any free pair (default: none published)")
    p.add_argument("--kv-transfer-port", type=PORT, default=None,
                   help="--role prefill: the port decode replicas pull KV from (default: any "
                        "free one, given in GET /fleet)")
    add_engine_args(p)
    g = p.add_argument_group("fleet (several engines behind a router on --port)")
    g.add_argument("--replicas", type=POSITIVE, default=1,
                   help="engines to start on this host (devices split among them; on the CPU "
                        "the cores)")
    g.add_argument("--ray", action="store_true",
                   help="run the replicas and the router as Ray Serve deployments")
    g.add_argument("--ray-address", default=None,
                   help="--ray: the cluster to join (default: start a local one)")
    g.add_argument("--ray-num-gpus", type=float_in(0), default=None,
                   help="--ray: GPUs per replica (default: 1 on CUDA, 0 on the CPU)")
    add_router_args(g)
    add_quiet(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("worker", help="run this host's ranks of an engine started on another "
                                      "host with --nnodes")
    p.add_argument("--distributed-init", required=True, metavar="tcp://HOST:PORT",
                   help="the engine's --distributed-init")
    p.add_argument("--node-rank", type=int_in(1), required=True,
                   help="this host's index, from 1")
    p.add_argument("--nnodes", type=int_in(2), default=None,
                   help="checked against the engine's (default: none, not checked)")
    add_quiet(p)
    p.set_defaults(func=_cmd_worker)

    p = sub.add_parser("router", help="one OpenAI-compatible endpoint over several replicas")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat per replica)")
    p.add_argument("--host", type=host, default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=PORT, default=8000, help="the port to listen on")
    p.add_argument("--model", "-m", default=None,
                   help="the replicas' model (its tokenizer and chat template hash prompts "
                        "for cache-aware routing); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' of clients and send it to the "
                        "replicas (default: $SKYLINE_API_KEY)")
    p.add_argument("--uvicorn-log-level", default="info", choices=_UVICORN_LEVELS,
                   help="how much the HTTP server logs")
    add_router_args(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_router)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("offline", help="offline throughput on random prompts")
    b.add_argument("--num-prompts", type=POSITIVE, default=64, help="prompts, all at once")
    b.add_argument("--input-len", type=POSITIVE, default=128, help="tokens per prompt")
    b.add_argument("--output-len", type=POSITIVE, default=128, help="tokens per output")
    b.add_argument("--output", default=None, help="JSON file for the results (default: none)")
    b.add_argument("--floor", action="store_true",
                   help="measure the device's matmul peak and copy bandwidth first and report "
                        "the run against the floor they set")
    add_engine_args(b)
    add_quiet(b)
    b.set_defaults(func=_cmd_bench_offline)
    b = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)")
    b.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's API")
    b.add_argument("--model", default=None, help="model name (default: the server's first)")
    b.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    b.add_argument("--temperature", type=float_in(0), default=0.0, help="0: greedy")
    b.add_argument("--output", default=None, help="JSON file for the results (default: none)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_load_args(b)
    add_quiet(b)
    b.set_defaults(func=_cmd_bench_serve)

    p = sub.add_parser("tune", help="tune kernels for this device: profile a workload, tune "
                                    "the family that loses the most time, keep what wins")
    add_tune_args(p)
    add_engine_args(p)
    add_quiet(p)
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("frontier", help="sweep engine settings x load levels; Pareto report")
    p.add_argument("--grid", action="append", metavar="FLAG=V1,V2",
                   help="a serve flag and its values, e.g. max_num_seqs=8,32 (repeatable; "
                        "true/false for switches; default: the base flags alone)")
    p.add_argument("--base-flags", default="", help="serve flags every setting shares")
    p.add_argument("--output-dir", default="bench/tmp/frontier",
                   help="where the JSON, plots and HTML report go")
    p.add_argument("--dry-run", action="store_true", help="list the points and a time estimate")
    p.add_argument("--no-quality", dest="quality", action="store_false",
                   help="skip KL / top-1 agreement against the reference")
    p.add_argument("--reference-flags", default="--quantization none",
                   help="flags (over --base-flags) of the quality reference")
    p.add_argument("--calib-tokens", type=POSITIVE, default=512,
                   help="tokens of calibration text")
    p.add_argument("--num-gpus", type=POSITIVE, default=1, help="devices a setting uses")
    p.add_argument("--percentile", default="median", choices=["median", "p90", "p99"],
                   help="latency percentile of the per-user axes")
    p.add_argument("--startup-timeout", type=float_in(0, lo_open=True), default=600.0,
                   help="seconds a setting's server may take to start")
    p.add_argument("--port", type=port_range, default=None, metavar="PORT|LO-HI",
                   help="the port of each setting's server (one runs at a time): this one, or "
                        "the first free one in LO-HI (default: any free port)")
    add_load_args(p, sweep=True)
    add_quiet(p)
    p.set_defaults(func=_cmd_frontier)

    p = sub.add_parser("quantize", help="write a quantized safetensors checkpoint")
    p.add_argument("model_path", metavar="MODEL", help="HF model directory or .gguf file")
    p.add_argument("--format", default=None, choices=["fp8", "int8", "int4", "mxfp4", "nvfp4"],
                   help="one format for every Linear (no default: give it, or --search)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--group-size", type=POSITIVE, default=128, help="int8/int4 group size")
    p.add_argument("--calib-file", default=None,
                   help="calibration text file (default: a built-in public-domain text)")
    p.add_argument("--calib-self", action="store_true",
                   help="calibrate on the model's own answers to built-in prompts (sampled "
                        "first; the text it will write when serving)")
    p.add_argument("--calib-tokens", type=POSITIVE, default=None,
                   help="calibration tokens (default 4096; with --search 1024, and the "
                        "following --eval-tokens are held out for the report)")
    p.add_argument("--search", action="store_true",
                   help="choose a format per Linear for --budget by the end-to-end KL")
    p.add_argument("--budget", default=None,
                   help="--search: bits per weight (e.g. 4.5), bytes of the Linear layers "
                        "(e.g. 60MiB), or a format (e.g. int4-g32: its uniform size); no "
                        "default")
    p.add_argument("--formats", default=None,
                   help="--search: candidate formats, comma-separated; int4/int8 take -gN for "
                        "a group size (default: mxfp4,nvfp4,int4,int4-g64,int4-g32,fp8,int8)")
    p.add_argument("--eval-tokens", type=POSITIVE, default=1024,
                   help="--search: held-out tokens the report is measured on")
    p.add_argument("--search-tokens", type=POSITIVE, default=512,
                   help="--search: calibration tokens each assignment is scored on")
    p.add_argument("--max-evals", type=POSITIVE, default=64,
                   help="--search: joint evaluations of the local search")
    add_quiet(p)
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("train-speculator",
                       help="train an EAGLE-style speculative head by self-distillation")
    add_engine_args(p)
    t = p.add_argument_group("training")
    t.add_argument("--prompts", default=None, metavar="FILE",
                   help=".txt (an instruction a line) or .jsonl (prompts, {prompt, completion} "
                        "traffic or chat messages); default: the built-in instruction set")
    t.add_argument("--out", required=True, metavar="DIR", help="where to write the head")
    t.add_argument("--num-prompts", type=POSITIVE, default=None,
                   help="sample this many prompts (default: all)")
    t.add_argument("--synthesize", type=NON_NEGATIVE, default=0, metavar="N",
                   help="also train on N user messages the target writes itself after its "
                        "chat template's user header (Magpie); kept if they end by themselves")
    t.add_argument("--max-tokens", type=POSITIVE, default=128,
                   help="tokens of each continuation the target writes")
    t.add_argument("--temperature", type=float_in(0), default=0.0,
                   help="continuations: 0 greedy, else sampled")
    t.add_argument("--epochs", type=POSITIVE, default=4, help="passes over the data")
    t.add_argument("--steps", type=POSITIVE, default=None,
                   help="stop after this many steps (default: when the epochs end)")
    t.add_argument("--lr", type=float_in(0, lo_open=True), default=2e-3, help="learning rate")
    t.add_argument("--batch-tokens", type=POSITIVE, default=2048, help="positions per step")
    t.add_argument("--unroll", type=POSITIVE, default=3,
                   help="draft steps simulated in training (training-time test)")
    t.add_argument("--draft-vocab", type=POSITIVE, default=8192,
                   help="tokens the head may propose (the most frequent in the data)")
    add_quiet(p)
    p.set_defaults(func=_cmd_train_speculator)
    return parser


def _omp_wait_passive() -> None:
    """Idle OpenMP workers sleep instead of spinning: spinning workers make CPU decode several
    times slower whenever another process wants a core, at a cost of ~15% on a quiet machine
    (bench/omp_wait_policy.py). OpenMP reads this once, when torch loads it, so the CLI sets it
    before anything imports torch; spawned engine processes inherit it. A user's value wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> None:
    _omp_wait_passive()
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    ns.argv = argv
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    progress.set_enabled(not ns.quiet)
    try:
        ns.func(ns)
    except (ConfigError, ValueError) as e:
        sys.exit(f"skyline: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
