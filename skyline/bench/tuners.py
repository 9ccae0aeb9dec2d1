"""What the kernel tuners and probes of bench/kernels/ share: the device they tune on, GPU time
per call from CUDA graphs, the Linear shapes of the shipped configs, random quantized weights.

`--smoke` (every tuner has it) runs a tuner on the CPU, its Triton kernels in Triton's
interpreter (TRITON_INTERPRET=1, set by the script before Triton loads) on tiny shapes: each
code path runs in seconds, the timings are wall clock and mean nothing, and the tables go to a
temporary directory, never to skyline/ops/configs/.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skyline.config import ModelArch
from skyline.configs import dummy_config_dir

ROTATE_BYTES = 256 << 20  # weight copies per shape add up to at least this (5x an H200's L2)
REPLAY_S = 2e-3  # target length of one timed graph replay


def interpret_for_smoke(argv: list[str]) -> None:
    """For `--smoke` without a GPU: Triton's interpreter, which must be chosen before Triton
    and skyline's settings (skyline/envs.py) are imported: call this first thing in a tuner
    (this module imports neither)."""
    if "--smoke" in argv and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class TuneDevice:
    """Where a tuner runs: a GPU, or (smoke) the CPU under Triton's interpreter."""

    device: torch.device
    name: str  # the GPU's name, as the tuning tables are keyed
    slug: str  # "h200": file names of tables and reports
    num_sms: int
    out_dir: str | None  # smoke runs: a temporary directory for tables and reports

    def path(self, default: str, given: str | None = None) -> str:
        """Where to write a table or report: `given`, else its `default` place (a smoke run:
        the same name in out_dir)."""
        if given is not None:
            return given
        return default if self.out_dir is None else os.path.join(self.out_dir,
                                                                 os.path.basename(default))


def tune_device(script: str, smoke: bool) -> TuneDevice:
    """The GPU a tuner runs on; with `smoke` and no GPU, the CPU. Exits with one sentence
    when a real run has no GPU."""
    out_dir = tempfile.mkdtemp(prefix="skyline-smoke-") if smoke else None
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return TuneDevice(torch.device("cuda"), name, device_slug(name), sms, out_dir)
    if not smoke:
        raise SystemExit(f"{script} needs a CUDA GPU; run it on the GPU machine (or --smoke)")
    print(f"{script} --smoke: no GPU, kernels in Triton's interpreter on tiny shapes; the "
          "times are not measurements", flush=True)
    return TuneDevice(torch.device("cpu"), "cpu (smoke)", "smoke", 4, out_dir)


def device_bandwidth(dev: TuneDevice, elements: int = 2**30) -> float:
    """Copy bandwidth (read + write bytes per second) of `dev`: `elements` bf16 values (2 GiB)
    on a GPU, a small copy on the CPU."""
    from skyline.bench.floor import copy_bandwidth  # (the engine's imports read the settings)

    return copy_bandwidth(dev.device, elements if dev.device.type == "cuda" else 2**20)


def time_calls(fns: list[Callable[[], Any]], calls: int, replays: int = 5) -> float:
    """Seconds per call: `calls` calls cycling over `fns`, captured in one CUDA graph (as
    decode replays them), median of `replays` replays after a warm one. On the CPU (smoke
    runs) the calls run once, timed by the wall clock."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        return (time.perf_counter() - t) / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del graph
    return sorted(times)[len(times) // 2] / calls


def linear_shapes(models: list[str]) -> dict[tuple[int, int], list[str]]:
    """{(N, K): ["llama-3.1-8b.qkv", ...]} over the models' decoder-layer products
    (ModelArch.layer_linears) and LM head."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in models:
        a = model_arch(model)
        layers = {**a.layer_linears(), "lm_head": (a.vocab_size, a.hidden_size)}
        for name, nk in layers.items():
            shapes.setdefault(nk, []).append(f"{model}.{name}")
    return shapes


def shipped_config(model: str) -> dict[str, Any]:
    """config.json of a shipped config (skyline/configs/)."""
    folder = dummy_config_dir(model)
    if folder is None:
        raise SystemExit(f"no shipped config called {model!r}; see skyline/configs/")
    return json.loads((Path(folder) / "config.json").read_text())


def model_arch(model: str) -> ModelArch:
    """The architecture of a shipped config's name or a HF model directory."""
    folder = dummy_config_dir(model) or model
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise SystemExit(f"{model!r} is neither a shipped config nor a HF model directory")
    return ModelArch.from_hf_config(json.loads(path.read_text()))


def random_quant_weights(fmt: str, n: int, k: int, group: int, device: torch.device
                         ) -> tuple[tuple[torch.Tensor, ...], int]:
    """Random weights of one [n, k] Linear in `fmt` ("fp8": e4m3 rows and their scales;
    "int8" / "int4": group-wise codes, scales and zeros), as the GEMVs take them after x, and
    their bytes (weights + scales + zeros)."""
    if fmt == "fp8":
        w = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(n, device=device) * 1e-3 + 1e-4
        return (w, s), w.numel() + s.numel() * 4
    bits = 8 if fmt == "int8" else 4
    groups = -(-k // group)
    codes = torch.randint(0, 256, (n, groups * group * bits // 8), dtype=torch.uint8,
                          device=device)
    scales = torch.rand(n, groups, device=device) * 2e-3 + 1e-4
    zeros = torch.randint(0, 2**bits, (n, groups), dtype=torch.uint8, device=device)
    return (codes, scales, zeros), codes.numel() + scales.numel() * 5


def copy_to_out(path: str) -> None:
    """A copy of `path` under $OUT (the GPU machine hands back only what is there), unless it
    is already there."""
    if os.environ.get("OUT"):
        copy = Path(os.environ["OUT"]) / Path(path).name
        if copy.resolve() != Path(path).resolve():
            shutil.copy(path, copy)


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200"."""
    return name.lower().removeprefix("nvidia").strip().replace(" ", "-")


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
