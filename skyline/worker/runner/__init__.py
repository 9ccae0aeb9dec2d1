"""The model runner: owns the model, the KV cache and per-request token state on one device.

A step is launched (`launch`) and later collected (`collect`). With async scheduling the
engine launches step n+1 before collecting step n: `launch` queues n+1's forward pass on the
device, then waits for step n's tokens (the device is busy with n+1 meanwhile), records them,
and queues n+1's sampling; it hands step n's output back. Sampling comes after the wait so
penalties and seeded draws see every earlier token. Without async scheduling (or with
speculative decoding, whose verification needs the tokens at once) a step is launched and
collected in turn, as `execute` does.

In a parallel layout each rank has a runner over its part of the model (`layout`): every rank
runs every step; a pipeline stage takes its input from the previous stage and sends its output
on (worker/step.py: a step as micro-batches); the last stage's first rank (the driver) samples
and its output is the step's; the ranks that embed tokens receive the driver's.

startup.py holds the runner's start-up (loading, profiling, sizing the KV cache, capturing CUDA
graphs) and its shutdown; launch.py a step's way through it (`launch`, `collect`, sampling,
proposals).
"""

from skyline.worker.runner.launch import CPU_SERIAL_TOKENS, KV_WAIT_S, ModelRunner
from skyline.worker.runner.startup import DTYPES, RunnerStartup

__all__ = ["CPU_SERIAL_TOKENS", "DTYPES", "KV_WAIT_S", "ModelRunner", "RunnerStartup"]
