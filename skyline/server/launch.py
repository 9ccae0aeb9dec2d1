"""`skyline serve` of one API process: bind the port, start the engine-core process, and while it
starts import the API's modules (server/app.py: FastAPI, the routes, uvicorn), then build the app
and serve (`run_app`). This module imports none of them itself, so that the engine process is
spawned first. With --api-server-count N, server/api_servers.py runs N API processes instead.
"""

from __future__ import annotations

import errno
import importlib
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skyline.engine.frontend.async_llm import AsyncLLM
from skyline.engine.supervisor import EngineDeadError, RestartPolicy
from skyline.types.startup import process_seconds

if TYPE_CHECKING:
    from skyline.server.limits import RequestLimits

DEFAULT_PARSE_WORKERS = 2

# What serving imports after the engine has started, imported while it starts.
API_MODULES = ("skyline.server.app", "uvicorn", "skyline.server.lifecycle")


def _import_api() -> None:
    for name in API_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # imported again where it is used: that import raises it
            return


@dataclass(frozen=True)
class ServeOptions:
    """What `serve` passes to each API process's app."""

    api_key: str | None = None
    limits: RequestLimits | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    max_waiting: int | None = None
    chat_template: str | None = None
    parse_workers: int = DEFAULT_PARSE_WORKERS
    tool_call_parser: str = "auto"


def bind_socket(host: str, port: int, reuse_port: bool = False,
                listen: bool = True) -> socket.socket:
    """A listening socket on host:port; `reuse_port`: one of several on the same port
    (SO_REUSEPORT: the kernel spreads new connections over them). `listen=False`: bound only
    (the port is held, connections are refused) until the server starts listening on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        except (AttributeError, OSError):  # not on this system: a second bind will fail
            pass
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                          "or stop the process using it") from None
        # Not the port: the host is no address of this machine, or its name does not resolve.
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); --host must be an address "
                      "of this machine: 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                      "interface)") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(engine_args: Any, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, limits: RequestLimits | None = None,
          shutdown_timeout: float = 30.0, log_level: str = "info",
          restart: RestartPolicy | None = None, max_waiting: int | None = None,
          chat_template: str | None = None,
          parse_workers: int = DEFAULT_PARSE_WORKERS, tool_call_parser: str = "auto",
          api_server_count: int = 1) -> None:
    """Run the server until SIGTERM / Ctrl-C. Raises OSError / EngineStartError with one
    sentence when it cannot start, EngineDeadError when the engine failed more often than
    `restart` allows."""
    options = ServeOptions(api_key=api_key, limits=limits, shutdown_timeout=shutdown_timeout,
                           log_level=log_level, max_waiting=max_waiting,
                           chat_template=chat_template, parse_workers=parse_workers,
                           tool_call_parser=tool_call_parser)
    if api_server_count > 1:
        from skyline.server.api_servers import serve_many

        return serve_many(engine_args, api_server_count, host, port, options,
                          restart or RestartPolicy())
    sock = bind_socket(host, port)
    # The API's modules import in a thread while the engine process starts: off the path to
    # /health, which the engine's start sets.
    importer = threading.Thread(target=_import_api, name="skyline-import-api", daemon=True)
    importer.start()
    fatal: list[str] = []
    servers: list[Any] = []

    def on_fatal(reason: str) -> None:
        # The engine will not come back: stop serving (in-flight requests end with errors)
        # and exit non-zero, so that whatever supervises the server restarts it.
        fatal.append(reason)
        for s in servers:
            s.should_exit = True

    before = process_seconds()  # the interpreter's start, the CLI's imports and arguments
    try:
        llm = AsyncLLM(engine_args, restart=restart, on_fatal=on_fatal, max_waiting=max_waiting,
                       chat_template=chat_template)
    except BaseException:
        sock.close()
        # No import left running in a daemon thread while the interpreter exits with the
        # error: a thread stopped there mid-import can abort the exit (a warning it writes
        # finds stderr's lock held at shutdown) instead of the one sentence the CLI prints.
        importer.join()
        raise
    if before is not None:
        llm.startup.seconds = {"api_imports": before, **llm.startup.seconds}
    try:
        # within the try: an API module that fails to import must not leave the engine up
        importer.join()
        from skyline.server.app import banner, run_app

        def announce(fmt: str | None) -> None:
            print(banner(llm.info, host, sock.getsockname()[1], fmt), flush=True)

        run_app(llm, sock, options, servers, announce)
    finally:
        llm.shutdown()  # already done by the lifespan unless uvicorn failed
        sock.close()
    if fatal:
        raise EngineDeadError(f"{fatal[0]}; the server stopped")
