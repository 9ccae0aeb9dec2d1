"""Kernel launch configurations as data: tuned per device model, looked up by kernel and shape
key.

`bench/kernels/tune_kernels.py` measures candidate configurations on a GPU and writes them with
`write_configs` into a JSON file under `skyline/ops/configs/`:

    {"device": "NVIDIA H200", "meta": {...},
     "configs": {"rms_norm": {"d4096:bf16:t64": {"BLOCK_M": 1, "num_warps": 8}, ...}, ...}}

At run time `get_config` merges every file in that folder whose "device" is the current CUDA
device's name, then every such file of this user's cache (`envs.ENV.kernel_cache_dir`, written
by `skyline tune`: a user's tune overrides the shipped tables on their device), and returns the
stored configuration for (kernel, key), or the caller's default (its heuristic) when there is
none. Keys are built by the kernel's own dispatcher; `token_bucket` rounds a token count up to
the counts the tuner measures, so one entry covers a range. A CPU's choices (ops/cpu_plan.py)
live in the same tables under `cpu_device_name()`.
"""

from __future__ import annotations

import functools
import json
import platform
import re
from pathlib import Path
from typing import Any

import torch

from skyline import envs

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# Token counts the tuner measures; a count is looked up under the next one up.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class KernelConfigError(ValueError):
    """A kernel configuration file that cannot be used."""


def token_bucket(num_tokens: int) -> int:
    """The smallest tuned token count >= num_tokens (the largest one beyond them)."""
    for b in TOKEN_BUCKETS:
        if num_tokens <= b:
            return b
    return TOKEN_BUCKETS[-1]


def dtype_name(dtype: torch.dtype) -> str:
    """Short dtype name used in keys: fp32, bf16, fp16 (str(dtype) for others)."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def get_config(kernel: str, key: str, default: dict[str, Any],
               device: str | None = None) -> dict[str, Any]:
    """The tuned launch configuration of `kernel` for shape `key` on `device` (default: the
    current CUDA device), over `default` (fields the file lacks keep their default); `default`
    when none is stored."""
    device = device or _current_device_name()
    found = tables(device).get(kernel, {}).get(key)
    return {**default, **found} if found else default


def tables(device: str | None) -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {key: config}} of `device`: the shipped tables, then this user's cache."""
    return _tables(str(CONFIG_DIR), envs.ENV.kernel_cache_dir, device)


def user_config_path(device: str) -> Path:
    """This user's table of `device` (what `skyline tune` writes)."""
    return Path(envs.ENV.kernel_cache_dir) / f"{device_slug(device)}.json"


def reload() -> None:
    """Forget the tables read so far (a file changed on disk)."""
    _tables.cache_clear()


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200"; "cpu: AMD EPYC 7B13" -> "cpu-amd-epyc-7b13"."""
    name = name.lower().removeprefix("nvidia")
    return re.sub(r"[^a-z0-9.]+", "-", name).strip("-") or "device"


@functools.cache
def cpu_device_name() -> str:
    """This CPU as its tables are keyed: "cpu: " and the model name the OS reports."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model or platform.processor() or platform.machine() or 'unknown'}"


def _hint(path: str | Path) -> str:
    if Path(path).resolve().parent != CONFIG_DIR:
        return "delete it or run `skyline tune` again"
    return "delete it or run bench/kernels/tune_kernels.py again"


def read_configs(path: str | Path) -> dict[str, Any]:
    """One configuration file, checked: {"device": str, "configs": {kernel: {key: dict}}}."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KernelConfigError(
            f"cannot read kernel configs {path} ({e}); {_hint(path)}") from None
    ok = (isinstance(data, dict) and isinstance(data.get("device"), str)
          and isinstance(data.get("configs"), dict)
          and all(isinstance(t, dict) and all(isinstance(c, dict) for c in t.values())
                  for t in data["configs"].values()))
    if not ok:
        raise KernelConfigError(
            f"kernel configs {path} lack a 'device' name or a 'configs' table of "
            f"{{kernel: {{key: config}}}}; {_hint(path)}")
    return data


def write_configs(path: str | Path, device: str, configs: dict[str, dict[str, dict[str, Any]]],
                  meta: dict[str, Any] | None = None) -> None:
    """Merge `configs` ({kernel: {key: config}}) into the file at `path` (created if absent),
    which must hold configurations for the same `device`; `meta` (date, command, versions)
    replaces the file's, whose earlier meta moves to its `history` (entries not re-tuned by
    this run keep the run that measured them on record)."""
    path = Path(path)
    data: dict[str, Any] = {"device": device, "meta": {}, "configs": {}}
    if path.exists():
        data = read_configs(path)
        if data["device"] != device:
            raise KernelConfigError(
                f"{path} holds configs for {data['device']!r}, not {device!r}; "
                "write to another file")
    for kernel, table in configs.items():
        data["configs"].setdefault(kernel, {}).update(table)
    if meta is not None:
        if data["meta"]:
            data["history"] = [*data.get("history", []), data["meta"]]
        data["meta"] = meta
    data["configs"] = {k: dict(sorted(t.items())) for k, t in sorted(data["configs"].items())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise KernelConfigError(
            f"cannot write kernel configs to {path} ({e.strerror or e}); set "
            "SKYLINE_KERNEL_CACHE to a folder you can write") from None
    _tables.cache_clear()


@functools.cache
def _tables(config_dir: str, user_dir: str, device: str | None
            ) -> dict[str, dict[str, dict[str, Any]]]:
    # {kernel: {key: config}} over every file for `device`: the shipped ones in name order,
    # then the user's (which override them)
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    if device is None:
        return merged
    user = Path(user_dir)
    paths = sorted(Path(config_dir).glob("*.json"))
    if user.is_dir() and user.resolve() != Path(config_dir).resolve():
        paths += sorted(user.glob("*.json"))
    for path in paths:
        data = read_configs(path)
        if data["device"] == device:
            for kernel, table in data["configs"].items():
                merged.setdefault(kernel, {}).update(table)
    return merged


def _current_device_name() -> str | None:
    if not torch.cuda.is_available():
        return None
    return _device_name(torch.cuda.current_device())


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)
