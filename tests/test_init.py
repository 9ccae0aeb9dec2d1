"""`import skyline` sets OpenMP's wait policy before torch loads, unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = "import os, skyline; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy_after_import(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_omp_wait_policy_default_passive_user_value_wins() -> None:
    assert _policy_after_import(None) == "PASSIVE"
    assert _policy_after_import("ACTIVE") == "ACTIVE"


def test_import_skyline_does_not_load_torch() -> None:
    # The policy only takes effect if OpenMP (torch) loads after skyline/__init__.py ran.
    probe = "import sys, skyline; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
