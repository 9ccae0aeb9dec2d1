"""skyline's CPU operations in C++ (ops/csrc): built once for this machine at their first use
and loaded as the operator namespace `torch.ops.skyline_cpu`.

The build is torch's cpp_extension (ninja and the C++ compiler; the ninja package is a
dependency), for this CPU's instructions (`-march=native`; its name carries the CPU's flags, torch's
version and the sources' hash, so a shared extensions directory never hands one machine or
torch another's build),
threaded by ATen's OpenMP, cached under torch's extensions directory (TORCH_EXTENSIONS_DIR):
about 20 s the first time on two cores, a load after. Where it cannot build (no compiler,
`SKYLINE_CPU_INTDOT=0`), `available()` is False and callers keep torch's own kernels.

- csrc/cpu_intdot.cpp: integer dot products of quantized weights (ops/cpu_intdot.py).
- csrc/cpu_decode.cpp: a Llama decode step's layers with no Python between operations
  (model/layers/cpu_decode.py), and the LM head's recomputation near each row's top
  (ops/cpu_linear.py's exact_near_top and exact_near_max).
- csrc/cpu_moe.cpp: a mixture-of-experts MLP of packed experts on the integer dot kernel
  (ops/cpu_moe.py).
- csrc/cpu_bf16.cpp: bfloat16 products for decode-sized batches on plain weights
  (ops/cpu_bf16.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch

from skyline import envs

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [os.path.join(_CSRC, name) for name in ("cpu_intdot.cpp", "cpu_decode.cpp",
                                                   "cpu_moe.cpp", "cpu_bf16.cpp")]

ANY_ROWS = 2**62  # what a product that takes batches of any size gives as its rows


class NativeProduct(NamedTuple):
    """A weight product the C++ decode step runs itself (csrc/cpu_decode.cpp's `product`)."""

    kind: int  # INT4_PLANE, INTDOT, BF16 or DENSE
    # (packed, scales_and_zeros) / (codes, scale, offset) / (the plain bfloat16 weight,) / ()
    tensors: tuple[torch.Tensor, ...]
    a: int  # group / bits
    b: int = 0  # - / group
    c: int = 0  # - / the activations' roundings (ops/cpu_intdot.py)
    rows: int = ANY_ROWS  # batches of more rows take `dense`
    dense: torch.Tensor | None = None  # [out, in] in the model dtype, oneDNN-packed or plain


INT4_PLANE = 0  # torch's int4 kernel, one plane (ops/cpu_int4.py)
INTDOT = 1  # the integer dot kernel (ops/cpu_intdot.py)
BF16 = 2  # the bfloat16 kernel (ops/cpu_bf16.py)
DENSE = 3  # no kernel: `dense` takes every batch (rows 0)


def available() -> bool:
    """Whether the operations are built (or build now) for this machine."""
    return _load() is not None


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    if not envs.ENV.cpu_intdot:
        return None
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        digest = hashlib.sha256()
        for path in [*SOURCES, os.path.join(_CSRC, "skyline_cpu.h")]:
            with open(path, "rb") as f:
                digest.update(f.read())
        march = envs.ENV.cpu_intdot_march
        # -fno-trapping-math: no operation here traps, and with it the element loops that
        # round (floor, float -> int) vectorize; results are the same
        cflags = ["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math"]
        # a build is for one CPU, one set of flags and one torch (its C++ ABI)
        digest.update(_cpu_flags().encode() + " ".join(cflags).encode()
                      + torch.__version__.encode())
        name = f"skyline_cpu_{digest.hexdigest()[:12]}"
        logger.info("loading skyline's CPU operations (built for this machine at first use, "
                    "~20 s)")
        folder = build_directory(name)
        with _build_lock(folder):
            cpp_extension.load(name, SOURCES, extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False, build_directory=folder)
        return name
    except Exception as e:  # no compiler, ninja or headers: torch's kernels serve
        logger.info("skyline's CPU operations are not built (%s); using torch's",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def build_directory(name: str) -> str:
    """Where the build `name` lives, as torch lays out a CPU build (TORCH_EXTENSIONS_DIR, else
    its default root; then py<version>_cpu/<name>)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folder = os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_cpu", name)
    os.makedirs(folder, exist_ok=True)
    return folder


@contextlib.contextmanager
def _build_lock(folder: str) -> Iterator[None]:
    """One build of `folder` at a time, under a lock the OS drops with its holder. torch's own
    lock is a file that a build killed midway (a ^C during the first start) leaves behind, and
    every later build then waits for it forever; holding this lock, no live build owns that
    file, so a leftover one is removed."""
    with open(os.path.join(folder, "skyline.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(folder, "lock")
            if os.path.exists(stale):
                logger.info("removing %s, left by a build that did not finish", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_on_path() -> None:
    # torch runs `ninja` from PATH; the ninja package's binary sits in an environment's bin
    # folder, which is not on PATH unless that environment is activated
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""
