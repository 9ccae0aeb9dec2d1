"""`import skyline` changes nothing in the process; the CLI sets OpenMP's wait policy (passive
after a short spin) before torch loads, unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = ("import os, sys, skyline.cli; assert 'torch' not in sys.modules; skyline.cli."
          "_omp_wait_policy(); print(os.environ.get('OMP_WAIT_POLICY'), "
          "os.environ.get('GOMP_SPINCOUNT'))")


def _run(probe: str, env_value: str | None, spin: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_cli_sets_passive_before_torch_loads_and_user_value_wins() -> None:
    from skyline.envs import OMP_DEFAULTS

    assert _run(_PROBE, None) == f"PASSIVE {OMP_DEFAULTS['GOMP_SPINCOUNT']}"
    assert _run(_PROBE, "ACTIVE") == "ACTIVE None"  # the user's policy, its own spin
    assert _run(_PROBE, None, "0") == "None 0"


def test_import_sets_nothing_and_loads_no_torch() -> None:
    probe = ("import os, sys, skyline; print('torch' in sys.modules, "
             "os.environ.get('OMP_WAIT_POLICY'))")
    assert _run(probe, None) == "False None"
