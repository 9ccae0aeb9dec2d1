"""The one argparse: `skyline serve | generate | chat | bench ...`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from skyline.config import ConfigError
from skyline.engine.create import EngineArgs
from skyline.types import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None,
                   help="HF model directory, .gguf file, or shipped config name (with "
                        "--load-format dummy); default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default="2GiB", help="CPU KV cache size, e.g. 4GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-blocks", type=int, default=None, help="fixed KV block count")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="CPU threads")
    g.add_argument("--quantization", default=None,
                   help="none | fp8 | int8 | int4 | mxfp4 | nvfp4 | gguf (default: the "
                        "checkpoint's own format; GGUF files dequantize at load)")
    g.add_argument("--quant-group-size", type=int, default=128,
                   help="int8/int4: input elements per scale")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")


def engine_args(ns: argparse.Namespace, **extra: Any) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    kw.update(extra)
    return EngineArgs(**kw)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    p = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                       top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                       seed=ns.sampling_seed)
    p.validate()
    return p


def _cmd_generate(ns: argparse.Namespace) -> None:
    from skyline.engine.frontend import LLM

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
    from skyline.engine.frontend import LLM

    llm = LLM(**dataclasses.asdict(engine_args(ns)))
    params = sampling_params(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print(f"skyline chat: {llm.config.model.name} (Ctrl-D or /exit to quit, /reset to clear)")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if ns.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        for out in llm.stream(llm.render_chat(history), params):
            reply.append(out.outputs[0].text)
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def _cmd_bench_offline(ns: argparse.Namespace) -> None:
    from skyline.bench.offline import run_offline

    run_offline(engine_args(ns), ns.num_prompts, ns.input_len, ns.output_len, ns.output)


def _cmd_serve(ns: argparse.Namespace) -> None:
    import os

    from skyline.engine.process import EngineStartError
    from skyline.server.app import serve

    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        logging.getLogger("skyline.server").setLevel(logging.INFO)  # request ids in the log
    if ns.model_tag is not None and ns.model is None:
        ns.model = ns.model_tag
    args = engine_args(ns, max_waiting=ns.max_waiting, served_model_name=ns.served_model_name)
    try:
        serve(args, host=ns.host, port=ns.port,
              api_key=ns.api_key or os.environ.get("SKYLINE_API_KEY"),
              max_body_bytes=ns.max_request_bytes, shutdown_timeout=ns.shutdown_timeout,
              log_level=ns.uvicorn_log_level)
    except (EngineStartError, OSError) as e:
        sys.exit(f"skyline: error: {e}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyline", description="LLM inference engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $SKYLINE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model id clients ask for")
    p.add_argument("--max-waiting", type=int, default=0,
                   help="waiting requests beyond which new ones get 429 (0: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20,
                   help="larger request bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--uvicorn-log-level", default="info")
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("offline", help="offline throughput on random prompts")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--output", default=None, help="JSON file for the results")
    add_engine_args(b)
    b.set_defaults(func=_cmd_bench_offline)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        ns.func(ns)
    except (ConfigError, ValueError) as e:
        sys.exit(f"skyline: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
