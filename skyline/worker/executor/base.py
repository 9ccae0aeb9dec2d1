"""Executors run a SchedulerOutput on the workers and answer what tools ask of the model.

The engine core talks to one `Executor`; it never sees a model or a tensor. `UniProcExecutor`
runs the one `ModelRunner` in the engine's own process; `MultiProcExecutor` (multiproc.py) one
per rank, each in a process of its own. Everything an executor returns is plain data or CPU
tensors, so both answer the same calls.

What tools ask of a loaded model (scoring text, hidden states, calibration, quantized
checkpoints, the format search) are the queries of worker/queries.py, run where the model lives:
`executor.query(name, *args)`.
"""

from __future__ import annotations

from typing import Any

from skyline.config import EngineConfig
from skyline.types import RunnerOutput, SchedulerOutput


class Executor:
    """The compute side of an engine. A step is launched (`launch`) and collected (`collect`);
    `execute` does both."""

    num_blocks: int
    max_num_seqs: int  # the runner's (chosen by it under max_num_seqs "auto")

    def launch(self, out: SchedulerOutput) -> RunnerOutput | None:
        """Queue a step; returns the output of the step that was in flight, if any."""
        raise NotImplementedError

    def collect(self) -> RunnerOutput:
        """Wait for the step in flight and return its output."""
        raise NotImplementedError

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        prev = self.launch(out)
        assert prev is None, "collect the step in flight first"
        return RunnerOutput() if out.empty else self.collect()

    def query(self, name: str, *args: Any) -> Any:
        """Run the query `name` of worker/queries.py on the model; returns its (plain) result."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What start-up reports: KV cache size, load time, weights' size."""
        return self.query("describe")

    def shutdown(self) -> None:
        """Release the workers (idempotent)."""


class UniProcExecutor(Executor):
    """One device, in this process: calls go straight to the runner."""

    def __init__(self, config: EngineConfig) -> None:
        from skyline.worker.runner import ModelRunner

        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.num_blocks
        self.max_num_seqs = self.runner.max_num_seqs

    def launch(self, out: SchedulerOutput) -> RunnerOutput | None:
        return self.runner.launch(out)

    def collect(self) -> RunnerOutput:
        return self.runner.collect()

    def query(self, name: str, *args: Any) -> Any:
        from skyline.worker.queries import QUERIES

        return QUERIES[name](self.runner, *args)

    def shutdown(self) -> None:
        self.runner.shutdown()
