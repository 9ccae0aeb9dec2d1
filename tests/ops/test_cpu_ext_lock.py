"""The C++ build's lock: a build killed midway (a ^C during the first start) leaves torch's
lock file behind, on which every later build would wait forever; skyline's own lock, which the
OS drops with its holder, lets the next build remove it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("fcntl")

from skyline.ops import cpu_ext  # noqa: E402

# takes skyline's build lock on the folder argv[1] (as a build does) and prints once it has it
_HOLD = """
import sys, time
from skyline.ops import cpu_ext
with cpu_ext._build_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(folder: str, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, folder, str(seconds)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_killed_builds_leftover_lock_is_removed(tmp_path) -> None:
    (tmp_path / "lock").touch()  # torch's lock file, as a killed build leaves it
    with cpu_ext._build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_builds_take_turns_and_a_killed_holder_lets_go(tmp_path) -> None:
    holder = _holder(str(tmp_path), 60)
    waiter = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "0"],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert waiter.poll() is None  # waits while the first holds the lock
    holder.kill()  # killed mid-build: the OS releases its lock
    holder.wait()
    out, _ = waiter.communicate(timeout=60)
    assert out.strip() == "held" and waiter.returncode == 0


def test_build_directory_is_torchs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_ext.build_directory("skyline_cpu_x")
    v = sys.version_info
    assert folder == str(tmp_path / f"py{v.major}{v.minor}_cpu" / "skyline_cpu_x")
