"""Placement as data: which layers run on which device, one pipeline stage per device.

`--placement cuda:0=28,cuda:1=20,cpu=8` gives each stage's device and layer count in order;
`--placement auto` computes them (`plan_stages`) from each device's measured free memory and
time per layer: every GPU takes layers in proportion to its speed (the slowest stage sets a
pipeline's pace, so the largest stage time is made as small as memory allows), and the CPU
only what the GPUs cannot hold. A CPU stage goes first, as llama.cpp's partial offload keeps
the first layers in system memory: the embedding is a cheap lookup there, and the LM head, the
largest product of a step, stays on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from skyline.config import ConfigError


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: decoder layers [start, end) on `device` ("cpu" or "cuda:N")."""

    device: str
    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class DeviceBudget:
    """What `plan_stages` knows of a device: the bytes the engine may take on it and one
    decoder layer's measured time for a decode step."""

    device: str
    free_bytes: int
    seconds_per_layer: float


def stages_from_counts(devices: Sequence[str], counts: Sequence[int]) -> list[Stage]:
    out, start = [], 0
    for device, n in zip(devices, counts, strict=True):
        out.append(Stage(device, start, start + n))
        start += n
    return out


def check_device(name: str) -> str:
    """A device name as a stage takes it: "cpu" or "cuda:N"."""
    name = name.strip()
    if name == "cpu" or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise ConfigError(f"a placement device must be cpu or cuda:N, got {name!r}")


def parse_placement(text: str, num_layers: int) -> list[Stage]:
    """Stages of "DEVICE=LAYERS,..." (e.g. "cuda:0=28,cuda:1=20,cpu=8"), in order; the counts
    must add up to the model's layers."""
    devices, counts = [], []
    for part in text.split(","):
        device, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise ConfigError(f"cannot read {part!r} of --placement; write DEVICE=LAYERS, "
                              "e.g. cuda:0=28,cpu=4")
        devices.append(check_device(device))
        counts.append(int(n))
    if sum(counts) != num_layers:
        raise ConfigError(f"--placement {text} places {sum(counts)} layers but the model has "
                          f"{num_layers}; make the counts add up to {num_layers}")
    return stages_from_counts(devices, counts)


def even_stages(num_layers: int, devices: Sequence[str]) -> list[Stage]:
    """`len(devices)` stages of as equal layer counts as can be (the first ones one larger:
    the last stage also holds the LM head)."""
    n = len(devices)
    if num_layers < n:
        raise ConfigError(f"the model has {num_layers} layers, fewer than the "
                          f"{n} pipeline stages asked for; use --pipeline-parallel-size "
                          f"{num_layers} or less")
    base, extra = divmod(num_layers, n)
    return stages_from_counts(devices, [base + (i < extra) for i in range(n)])


def plan_stages(num_layers: int, budgets: Sequence[DeviceBudget], layer_bytes: int,
                first_bytes: int = 0, last_bytes: int = 0) -> list[Stage]:
    """Stages for `num_layers` layers of `layer_bytes` each (weights and the KV cache a layer
    must at least have) over the devices of `budgets`. The first stage also holds
    `first_bytes` (the embedding), the last `last_bytes` (final norm and LM head). GPUs share
    the layers so that the slowest stage is as fast as memory allows; the CPU takes only what
    they cannot hold, and runs first. Devices that get no layer are left out."""
    gpus = [b for b in budgets if b.device != "cpu"]
    cpus = [b for b in budgets if b.device == "cpu"][:1]
    if not gpus and not cpus:
        raise ConfigError("no device to place the model on")

    def capacity(b: DeviceBudget, extra: int) -> int:
        return max(0, (b.free_bytes - extra) // max(layer_bytes, 1))

    # GPUs, fastest first: the head on the last GPU; the embedding on the first GPU unless a
    # CPU stage runs first.
    gpus.sort(key=lambda b: b.seconds_per_layer)
    counts = [0] * len(gpus)
    caps = [capacity(b, (last_bytes if i == len(gpus) - 1 else 0)
                     + (first_bytes if i == 0 else 0)) for i, b in enumerate(gpus)]
    for _ in range(min(num_layers, sum(caps))):
        # the GPU whose stage would be the fastest with one more layer
        best = min((i for i in range(len(gpus)) if counts[i] < caps[i]),
                   key=lambda i: ((counts[i] + 1) * gpus[i].seconds_per_layer, i))
        counts[best] += 1
    rest = num_layers - sum(counts)
    stages: list[tuple[str, int]] = []
    if rest:
        if not cpus or capacity(cpus[0], first_bytes + (last_bytes if not gpus else 0)) < rest:
            free = sum(b.free_bytes for b in budgets) / 2**30
            raise ConfigError(
                f"the model's {num_layers} layers need about "
                f"{(num_layers * layer_bytes + first_bytes + last_bytes) / 2**30:.1f} GiB and "
                f"the devices offer {free:.1f} GiB; use a smaller or quantized model, or give "
                "more memory (--gpu-memory-utilization, --kv-cache-memory)")
        stages.append((cpus[0].device, rest))
    stages += [(b.device, n) for b, n in zip(gpus, counts, strict=True) if n]
    return stages_from_counts([d for d, _ in stages], [n for _, n in stages])


def format_stages(stages: Sequence[Stage]) -> str:
    """The --placement text of `stages`."""
    return ",".join(f"{s.device}={s.num_layers}" for s in stages)
