"""`skyline serve` spawns the engine process before it imports the API's modules (FastAPI, the
routes, uvicorn), which then import in a thread while the engine starts: off the path to
/health."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from skyline.server import launch

# In a fresh interpreter: serve() up to the engine's start (a fake that records what was
# imported by then and stops the server).
SERVE_UNTIL_ENGINE = """
import sys, threading
from skyline.cli.serve import cmd_serve
import skyline.server.limits
from skyline.server import launch

class Started(Exception):
    pass

class Engine:
    def __init__(self, *args, **kwargs):
        print(sorted(m for m in ("fastapi", "uvicorn", "skyline.server.app") if m in sys.modules))
        print([t.name for t in threading.enumerate() if t.name == "skyline-import-api"])
        release.set()  # serve's error path waits for the imports
        raise Started

launch.AsyncLLM = Engine
release = threading.Event()
background = launch._import_api
launch._import_api = lambda: release.wait(30) and background()
try:
    launch.serve(None, port=0)
except Started:
    pass
"""


def test_serve_starts_the_engine_before_importing_the_api():
    r = subprocess.run([sys.executable, "-c", SERVE_UNTIL_ENGINE], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "['skyline-import-api']"]


def test_api_modules_import_in_the_background(monkeypatch):
    imported: list[str] = []
    monkeypatch.setattr(launch.importlib, "import_module", imported.append)
    launch._import_api()
    assert imported == list(launch.API_MODULES)
    assert "skyline.server.app" in launch.API_MODULES


def test_a_failed_start_leaves_no_import_running(monkeypatch):
    # The engine fails while the API's modules still import: serve raises only once the
    # importing thread is done (none left mid-import while the interpreter exits).
    def slow_import() -> None:
        time.sleep(0.3)

    class Failing:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("engine failed")

    monkeypatch.setattr(launch, "_import_api", slow_import)
    monkeypatch.setattr(launch, "AsyncLLM", Failing)
    with pytest.raises(RuntimeError, match="engine failed"):
        launch.serve(None, port=0)
    assert not [t for t in threading.enumerate() if t.name == "skyline-import-api"]


def test_an_api_import_failure_stops_the_engine(monkeypatch):
    stopped: list[bool] = []

    class Engine:
        startup = None

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def shutdown(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(launch, "_import_api", lambda: None)
    monkeypatch.setattr(launch, "AsyncLLM", Engine)
    monkeypatch.setattr(launch, "process_seconds", lambda: None)
    monkeypatch.setitem(sys.modules, "skyline.server.app", None)  # its import fails
    with pytest.raises(ImportError):
        launch.serve(None, port=0)
    assert stopped == [True]
