"""`import skyline` changes nothing in the process; the CLI sets OpenMP's wait policy before
torch loads, unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = ("import os, sys, skyline.cli; assert 'torch' not in sys.modules; skyline.cli."
          "_omp_wait_passive(); print(os.environ.get('OMP_WAIT_POLICY'))")


def _run(probe: str, env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_cli_sets_passive_before_torch_loads_and_user_value_wins() -> None:
    assert _run(_PROBE, None) == "PASSIVE"
    assert _run(_PROBE, "ACTIVE") == "ACTIVE"


def test_import_sets_nothing_and_loads_no_torch() -> None:
    probe = ("import os, sys, skyline; print('torch' in sys.modules, "
             "os.environ.get('OMP_WAIT_POLICY'))")
    assert _run(probe, None) == "False None"
