"""The commands that run a model in this process: generate, chat, bench, frontier, tune,
quantize, train-speculator."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from skyline.cli.args import (
    engine_args,
    load_specs,
    sampling_params,
)
from skyline.config import ConfigError
from skyline.engine.args import EngineArgs


def cmd_generate(ns: argparse.Namespace) -> None:
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


def cmd_chat(ns: argparse.Namespace) -> None:
    from skyline.engine.frontend.llm import LLM
    from skyline.tools.chat import run_chat

    run_chat(LLM(**dataclasses.asdict(engine_args(ns))), sampling_params(ns), ns.system)


def cmd_bench_offline(ns: argparse.Namespace) -> None:
    from skyline.bench.offline import run_offline

    run_offline(engine_args(ns), ns.num_prompts, ns.input_len, ns.output_len, ns.output,
                floor=ns.floor, sampling={"temperature": ns.temperature, "top_p": ns.top_p})


def cmd_bench_serve(ns: argparse.Namespace) -> None:
    import dataclasses as dc

    from skyline.bench.serve import run_serve_bench

    load, workload, slos = load_specs(ns)
    load = dc.replace(load, base_url=ns.base_url, model=ns.model, concurrency=ns.concurrency,
                      request_rate=ns.request_rate, temperature=ns.temperature,
                      top_p=ns.top_p,
                      api_key=ns.api_key or os.environ.get("OPENAI_API_KEY"),
                      progress=not (ns.no_progress or ns.quiet))
    run_serve_bench(load, workload, slos, ns.output)


def cmd_frontier(ns: argparse.Namespace) -> None:
    from skyline.bench.frontier import FrontierSpec, run_frontier
    from skyline.cli import build_parser

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


def cmd_tune(ns: argparse.Namespace) -> None:
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
        loop=LoopSpec(rounds=ns.rounds, budget_s=ns.budget_s, min_gain=ns.min_gain,
                      any_loss=ns.smoke),
        out=ns.out, smoke=ns.smoke, command="skyline " + " ".join(ns.argv))
    run_tune(engine_args(ns, **extra), spec)


def cmd_quantize(ns: argparse.Namespace) -> None:
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


def cmd_train_speculator(ns: argparse.Namespace) -> None:
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
