"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM, served by uvicorn.

`skyline serve` binds the port, starts the engine-core process (server/launch.py, which imports
this module while the engine starts), prints what it serves and runs uvicorn. SIGTERM (or
Ctrl-C) stops accepting connections, lets in-flight requests finish for up to
--shutdown-timeout seconds, ends the rest with an error each (an SSE error event and [DONE] for
streams), then stops the engine. With --api-server-count N, N API processes run this app in
front of one engine core (server/api_servers.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from skyline.engine.frontend.async_llm import AsyncLLM
from skyline.engine.gc_tuning import tune_gc
from skyline.server.chat import create_chat_completion
from skyline.server.completions import create_completion
from skyline.server.errors import error_body, install_error_handlers
from skyline.server.guard import Guard
from skyline.server.launch import DEFAULT_PARSE_WORKERS, ServeOptions
from skyline.server.limits import RequestLimits
from skyline.server.metrics import CONTENT_TYPE, Metrics
from skyline.server.parse import ParsePool
from skyline.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from skyline.server.responses.protocol import ResponsesRequest
from skyline.server.responses.route import create_response
from skyline.server.serving import ServerState
from skyline.server.tokenize import detokenize, tokenize
from skyline.server.tools import resolve_tool_format
from skyline.types.startup import format_phases

log = logging.getLogger("skyline.server")

# The routes parse their own bodies (off the event loop, within the limits): their schemas are
# declared here for /openapi.json.
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/v1/responses": ResponsesRequest,
}
CUT_GRACE_S = 5.0  # after cutting requests at the drain timeout, for their errors to be sent


def build_app(llm: AsyncLLM, *, api_key: str | None = None,
              limits: RequestLimits | None = None,
              parse_workers: int = DEFAULT_PARSE_WORKERS,
              tool_call_parser: str = "auto", api_server: int | None = None,
              multiprocess_dir: str | None = None,
              on_ready: Callable[[], None] | None = None) -> FastAPI:
    """`tool_call_parser`: a format of tool_parsers.PARSERS, "none", or "auto" (guessed from
    the chat template). `api_server`: this process's index among several API processes, which
    share their metrics through `multiprocess_dir`. `on_ready`: called once the app has
    started, just before the server accepts connections."""
    limits = (limits or RequestLimits()).resolved(llm.max_model_len)
    metrics = Metrics(llm.model_name, lambda: llm.stats, lambda: llm.num_restarts,
                      api_server=api_server, multiprocess_dir=multiprocess_dir)
    template = llm.tokenizer.chat_template if llm.tokenizer is not None else None
    state = ServerState(llm, llm.model_name, metrics, limits,
                        tool_format=resolve_tool_format(tool_call_parser, template))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.engine.start()  # watch the engine from now on, not from the first request
        state.parse_pool = ParsePool(parse_workers, limits)
        await state.parse_pool.start()
        if on_ready is not None:
            on_ready()
        yield
        # uvicorn has drained (or cancelled) the in-flight requests: stop the engine now, as
        # uvicorn re-raises SIGTERM once this returns.
        state.shutting_down = True
        await state.parse_pool.close()
        state.threads.shutdown(wait=False, cancel_futures=True)
        llm.shutdown()
        if api_server is None:  # else the parent says it, once
            print("skyline: server stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="skyline", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.skyline = state
    install_error_handlers(app)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       body_timeout_s=limits.body_timeout_s)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        # 503 while the engine restarts (or after it failed for good, or while shutting down)
        if llm.dead is not None:
            return JSONResponse(error_body(503, llm.dead), status_code=503,
                                headers={"Retry-After": "5"})
        return Response(status_code=200)

    @app.get("/fleet")
    async def fleet() -> dict[str, Any]:
        """What a router (skyline/router/) reads when this replica joins."""
        i = llm.info
        return {"pid": os.getpid(), **{k: i.get(k) for k in (
            "model_name", "role", "block_size", "num_blocks", "kv_events_port",
            "kv_transfer_port")}}

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=state.model_name, root=llm.info["model_path"],
                         max_model_len=llm.max_model_len)
        return ModelList(data=[card])

    @app.get("/metrics")
    async def metrics_route() -> Response:
        await llm.refresh_stats()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize_route(raw: Request) -> dict[str, Any]:
        return await tokenize(state, raw)

    @app.post("/detokenize")
    async def detokenize_route(raw: Request) -> dict[str, Any]:
        return await detokenize(state, raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await create_chat_completion(state, raw)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(state, raw)

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await create_response(state, raw)

    app.openapi = _openapi_with_bodies(app)  # type: ignore[method-assign]
    return app


def _openapi_with_bodies(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            for path, model in _BODIES.items():
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


# how a CPU rank's decode step runs its layers (model/weights.py's cpu_kernels)
_STEPS = {"native": "the C++ decode step", "python": "planned products called from Python",
          "modules": "module by module"}


def banner(i: dict[str, Any], host: str, port: int, tool_format: str | None = None,
           api_pids: list[int] | None = None) -> str:
    """What `serve` prints once it serves; `i`: the engine's info; `api_pids`: several API
    processes' (default: this one)."""
    where = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    weights = i.get("weights_gib")
    api = (f"API process: pid {os.getpid()}" if api_pids is None else
           f"{len(api_pids)} API processes: pids {', '.join(map(str, api_pids))}")
    lines = [
        f"skyline: serving {i['model_name']} ({i['model_path']}) at {where}/v1",
        f"  device {i['device']}, dtype {i['dtype']}, context {i['max_model_len']} tokens, "
        f"loaded in {i.get('load_seconds', 0):.1f}s"
        + (f", weights {weights:.2f} GiB" if weights else "")
        + (f" ({i['host_experts_gib']:.2f} GiB of experts in host memory)"
           if i.get("host_experts_gib") else ""),
        f"  KV cache {i.get('kv_cache_gib', 0):.2f} GiB: {i.get('num_blocks', 0)} blocks of "
        f"{i['block_size']} tokens ({i.get('kv_cache_tokens', 0)} tokens), "
        f"up to {i['max_num_seqs']} running requests",
        f"  engine core: pid {i['pid']}; {api}",
    ]
    for k in i.get("cpu_kernels") or []:  # what a CPU rank's one-row decode steps run
        linears = ", ".join(f"{n} {name}" for name, n in sorted(k["linears"].items()))
        head = f", LM head {k['lm_head']}" if k["lm_head"] else ""
        step = _STEPS.get(k["decode_step"], k["decode_step"])
        lines.append(f"  CPU decode kernels: Linears {linears or 'none'}{head}; {step}")
    if tool_format is not None:
        lines.append(f"  tool calls: the {tool_format} format")
    return "\n".join(lines)


def run_app(llm: AsyncLLM, sock: socket.socket, options: ServeOptions, servers: list[Any],
            announce: Callable[[str | None], None], api_server: int | None = None,
            multiprocess_dir: str | None = None) -> None:
    """Serve the app over `llm` on the listening `sock` until SIGTERM (or Ctrl-C, unless this
    is one of several API processes: their parent forwards it as SIGTERM); the uvicorn server
    is appended to `servers`, and `announce(tool format)` called once the app is built."""
    t0 = time.perf_counter()
    import uvicorn

    from skyline.server.lifecycle import DrainingServer, JSONErrorProtocol, escape_log_controls

    def ready() -> None:
        # The start-up record, complete: the engine process's phases, this process's
        # (bench/fast_start.py reads this line).
        llm.startup.add("api_server", time.perf_counter() - t0)
        phases = llm.startup.seconds
        log.info("started in %.1f s: %s", sum(phases.values()), format_phases(phases))
        log.info("start-up phases %s", json.dumps({k: round(v, 4) for k, v in phases.items()}))

    o = options
    app = build_app(llm, api_key=o.api_key, limits=o.limits, parse_workers=o.parse_workers,
                    tool_call_parser=o.tool_call_parser, api_server=api_server,
                    multiprocess_dir=multiprocess_dir, on_ready=ready)
    state: ServerState = app.state.skyline

    def drain() -> None:
        # SIGTERM: no new requests; those still running after the timeout are cut with an
        # error each (uvicorn's own timeout, a little later, would drop them mid-response).
        state.shutting_down = True
        asyncio.get_running_loop().call_later(o.shutdown_timeout, llm.cut_all,
                                              "the server shut down before this request "
                                              "finished; retry it on another replica")

    announce(state.tool_format.name if state.tool_format is not None else None)
    config = uvicorn.Config(app, log_level=o.log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=o.shutdown_timeout + CUT_GRACE_S,
                            http=JSONErrorProtocol)
    escape_log_controls()
    # This process streams every request's outputs: the engine's garbage-collector
    # settings keep full collections (a pause of every stream) rare here too.
    tune_gc()
    servers.append(DrainingServer(config, drain, ignore_sigint=api_server is not None))
    servers[-1].run(sockets=[sock])
