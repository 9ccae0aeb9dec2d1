"""The floor of an offline run: the least time the device needs for its arithmetic and its
bytes, at the matmul peak and the copy bandwidth measured in the same run.

Every token, prompt or output, goes through the Linear layers: 2 FLOPs per weight element (the
LM head only for the tokens that sample). A prompt's attention is arithmetic (causal: one
query-key pair per earlier token); an output token's attention reads the K/V of its whole
context once. A decode step also reads every weight once, whatever its batch (of a
mixture-of-experts model, the dense weights and every expert any of its tokens is routed to;
its arithmetic counts each token's experts only). Two floors:

- sequential: a step runs its products and then its attention, one after the other: prefill
  arithmetic at the peak, each decode step's products at the larger of their FLOPs over the
  peak and the weights over the bandwidth, and the decode attention at the larger of its K/V
  over the bandwidth and its FLOPs over the peak.
  An engine that runs each kernel at its own roofline reaches it.
- overlapped: the larger of all FLOPs over the peak and all bytes over the bandwidth, which no
  schedule beats.

Both assume every request decodes with the same step count as the others (`concurrency` at a
time): a run with fewer rows per step than that can only be slower.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from skyline.engine.cost import ModelCost


def offline_floor(cost: ModelCost, num_prompts: int, input_len: int, output_len: int,
                  concurrency: int, peak_flops: float, bandwidth: float) -> dict[str, Any]:
    """Seconds and output tok/s of both floors for prompts of `input_len` tokens, each making
    `output_len` tokens (the first by its prefill), `concurrency` requests decoding at once."""
    concurrency = max(1, min(concurrency, num_prompts))
    n_decode = num_prompts * (output_len - 1)  # tokens fed by decode steps
    steps = math.ceil(num_prompts / concurrency) * (output_len - 1)
    rows = n_decode / steps if steps else 0.0
    per_token = 2 * (cost.linear_params + cost.head_params)
    prefill_flops = (2 * cost.linear_params * num_prompts * input_len
                     + 2 * cost.head_params * num_prompts
                     + cost.attn_flops_per_pair * num_prompts * input_len * (input_len + 1) / 2)
    # The decode token t (1 .. output_len - 1) attends to input_len + t keys.
    keys = num_prompts * ((output_len - 1) * input_len + (output_len - 1) * output_len / 2)
    kv_bytes = keys * cost.kv_bytes_per_token
    prefill_s = prefill_flops / peak_flops
    step_bytes = cost.step_weight_bytes(rows)
    decode_linear_s = steps * max(step_bytes / bandwidth, per_token * rows / peak_flops)
    decode_attention_s = max(kv_bytes / bandwidth, cost.attn_flops_per_pair * keys / peak_flops)
    total_flops = prefill_flops + per_token * n_decode + cost.attn_flops_per_pair * keys
    total_bytes = steps * step_bytes + kv_bytes
    sequential_s = prefill_s + decode_linear_s + decode_attention_s
    # never above the sequential floor (equal when every part is bound the same way, where the
    # two sums may round apart)
    overlapped_s = min(max(total_flops / peak_flops, total_bytes / bandwidth), sequential_s)
    out_tokens = num_prompts * output_len
    return {
        "peak_TFLOPs": peak_flops / 1e12, "bandwidth_TBps": bandwidth / 1e12,
        "concurrency": concurrency, "decode_steps": steps, "cost": asdict(cost),
        "prefill_s": prefill_s, "decode_linear_s": decode_linear_s,
        "decode_attention_s": decode_attention_s,
        "sequential_s": sequential_s, "sequential_tok_s": out_tokens / sequential_s,
        "overlapped_s": overlapped_s, "overlapped_tok_s": out_tokens / overlapped_s,
    }


def median_seconds(fn: Any, device: torch.device, reps: int) -> float:
    """Median seconds of `reps` calls of `fn` on `device` (CUDA events on a GPU) after three
    warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize(device)
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, elements: int | None = None) -> float:
    """Bytes read plus written per second by a device-to-device copy of `elements` bf16 values
    (default 2 GiB on a GPU, 64 MiB on the CPU), median of 20 after 3 warm-ups."""
    n = elements or (2**30 if device.type == "cuda" else 2**25)
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * n * 2 / median_seconds(lambda: y.copy_(x), device, 20)


def host_read_bandwidth(threads: int | None = None, nbytes: int = 1 << 30, buffers: int = 3
                        ) -> float:
    """Bytes per second host memory reads at: the best of a float32 sum and a float32 maximum
    over each of `buffers` buffers of `nbytes` allocated in turn, each read the best of 5 after
    one, at `threads` threads, or by default at torch's and at every CPU this process may run
    on. 1 GiB: a server CPU's last-level cache reaches 300 MiB, which a smaller buffer may be
    read partly from. Several buffers: a virtual machine's memory may be backed unevenly (two
    1 GiB buffers of one process on the CPU machine read at 36 and 66 GB/s, and a single one at
    one thread count read at a third of what both engines then read on a GPU machine's host).
    The memory is advised to transparent huge pages where Linux has them (as a CPU engine's
    streamed weights are, ops/host_memory.py): in 4 KiB pages the same sum reads ~10-15%
    slower."""
    prev = torch.get_num_threads()
    counts = sorted({threads} if threads else {prev, len(_usable_cpus())})
    best = 0.0
    try:
        for _ in range(buffers):
            x = _huge_page_ones(nbytes // 4)
            for n in counts:
                torch.set_num_threads(n)
                for read in (x.sum, x.amax):
                    best = max(best, nbytes / _best_seconds(read, 5))
            del x
    finally:
        torch.set_num_threads(prev)
    return best


def _best_seconds(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _usable_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _huge_page_ones(n: int) -> torch.Tensor:
    try:
        mm = mmap.mmap(-1, 4 * n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # not Linux: torch's memory
        return torch.ones(n)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    at = -base.data_ptr() % (2 << 20)
    return base[at:at + 4 * n].view(torch.float32).fill_(1.0)


def matmul_peak(device: torch.device, fp8: bool = False) -> float:
    """FLOP/s of a large square product: bf16 on a GPU (fp8 x fp8 through `torch._scaled_mm`
    with `fp8` on one that has fp8 units), float32 on the CPU."""
    if device.type != "cuda":
        a = torch.randn(1024, 1024)
        b = torch.randn(1024, 1024)
        return 2 * 1024**3 / median_seconds(lambda: a @ b, device, 10)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    fn = lambda: a @ b  # noqa: E731
    if fp8 and torch.cuda.get_device_capability(device) >= (8, 9):  # fp8 tensor cores
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(n, 1, device=device)
        sb = torch.ones(1, n, device=device)
        fn = lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,  # noqa: E731
                                      out_dtype=torch.bfloat16)
    return 2 * n**3 / median_seconds(fn, device, 10)


def host_to_device_bandwidth(device: torch.device) -> float:
    """Bytes per second copied from page-locked host memory to the device (1 GiB on a GPU; on
    the CPU, a copy between two host buffers)."""
    n = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    return n / median_seconds(lambda: dst.copy_(src, non_blocking=True), device, 10)


def drop_page_cache(paths: list[str]) -> None:
    """Write the files out and ask the kernel to forget their cached pages, so the next read
    comes from the disk (advice, not a guarantee: the JSON says what was measured)."""
    import os

    os.sync()
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_rate(directory: str, size: int, threads: int = 8, chunk: int = 8 << 20) -> float:
    """Bytes per second read from a file of `size` bytes written in `directory` and dropped
    from the page cache, by `threads` readers of `chunk`-byte pieces (the KV disk tier's
    reader count)."""
    import concurrent.futures as cf
    import os

    path = os.path.join(directory, f".read-rate-{os.getpid()}")
    block = os.urandom(min(chunk, size))
    with open(path, "wb") as f:
        for _ in range(0, size, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        drop_page_cache([path])
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        bufs = [bytearray(chunk) for _ in range(threads)]

        def read(i: int) -> None:
            for off in range(i * chunk, size, threads * chunk):
                os.preadv(fd, [bufs[i]], off)

        t = time.perf_counter()
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        dt = time.perf_counter() - t
        os.close(fd)
        return size / dt
    finally:
        os.unlink(path)
