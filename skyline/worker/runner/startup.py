"""The model runner's start-up and shutdown: load the model on its device, profile the largest
step's activations, size and allocate the KV cache (and max_num_seqs "auto"), start the KV
connector, capture CUDA graphs; and give all of it back. `ModelRunner` (launch.py) adds the
steps."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from skyline import envs
from skyline.config import EngineConfig
from skyline.model.loader import DTYPES, load_model, prepack_for_cpu, prepack_host_experts
from skyline.model.partition import attention_layers
from skyline.ops.attention_dense import workspace_bytes
from skyline.ops.triton_utils import compiled_so_far, count_compiles, triton
from skyline.parallel.groups import ParallelLayout
from skyline.types.startup import StartupPhases
from skyline.worker.connector import make_connector
from skyline.worker.cuda_graph import (
    MAX_GRAPH_BATCH,
    CudaGraphRunner,
    auto_max_num_seqs,
    bucket_sizes,
    mixed_sizes,
)
from skyline.worker.inputs import RequestState
from skyline.worker.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    calibrate_kv_scales,
    kv_cache_dtype,
    num_blocks_for,
)
from skyline.worker.memory import check_memory
from skyline.worker.runner.step_threads import StepThreads
from skyline.worker.runner.warm import warm_eager_steps
from skyline.worker.spec.proposer import make_proposer
from skyline.worker.step import InFlight

# One logger for the whole runner package (the name its messages always had).
log = logging.getLogger("skyline.worker.runner")


class RunnerStartup:
    """The runner's state from start-up to shutdown: model, KV cache, graphs, connector."""

    def __init__(self, config: EngineConfig, layout: ParallelLayout | None = None) -> None:
        # Seconds of each phase below (describe's "startup"), and the Triton compilations
        # (or loads from Triton's disk cache) they ran.
        self.startup = StartupPhases()
        # The fusions unfused when this runner started: the unfuse query (worker/queries.py)
        # swaps the process-wide setting, and shutdown puts it back, so that the next engine
        # of the same process (LLM, a benchmark's) does not inherit a measurement's setting.
        self.unfuse_at_start = envs.ENV.unfuse
        with count_compiles() as self.triton_compiles:
            self._start(config, layout)
        # what steps compile from here on (a shape no warm-up reached): the step trace's
        self.compiles_at_start = compiled_so_far()

    def _start(self, config: EngineConfig, layout: ParallelLayout | None) -> None:
        self.config = config
        self.layout = layout or ParallelLayout.single(config.model.arch.num_layers,
                                                      config.device, config.parallel.n_cpu_moe)
        self.device = torch.device(self.layout.stage.device if layout else config.device)
        self.dtype = DTYPES[config.model.dtype]
        self.arch = config.model.arch
        self.block_size = config.cache.block_size
        if self.device.type == "cuda":  # the CUDA context: its own phase, off the weights' rate
            with self.startup.phase("device_init"):
                torch.zeros(1, device=self.device)
        t0 = time.perf_counter()
        torch.manual_seed(config.model.seed)
        if layout is None or layout.world_size == 1:  # a rank holds its own part only
            check_memory(config, self.device)  # one sentence, not the out-of-memory killer
        self.model = load_model(config.model, self.device, self.layout)
        if self.device.type == "cpu":
            prepack_for_cpu(self.model, self.dtype)  # oneDNN-packed: cheap few-row products
        else:
            prepack_host_experts(self.model, self.dtype)  # --n-cpu-moe: the CPU's layout
        self.load_seconds = time.perf_counter() - t0
        self.startup.add("load_weights", self.load_seconds)
        self.states: dict[str, RequestState] = {}
        self._scoring: set[str] = set()  # requests whose prompt logprobs are still to compute
        # None without speculative decoding
        with self.startup.phase("speculator"):
            self.proposer = make_proposer(config.spec, self.model)
        self.eos_ids: tuple[int, ...] = self.arch.eos_token_ids
        with self.startup.phase("profile"):
            peak = self._profile() if self.device.type == "cuda" else 0
        self.profile_peak_bytes = peak
        t0 = time.perf_counter()
        # Device memory in use when the KV cache is sized (all of it counts against the
        # budget: a leftover engine's weights would show here)
        self.memory_in_use_bytes = 0
        if self.device.type == "cuda":
            # Garbage first: an earlier engine's tensors caught in reference cycles would
            # otherwise count as in use until the collector's next full pass.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            self.memory_in_use_bytes = total - free
        sc = config.scheduler
        self.kv_dtype = kv_cache_dtype(config.cache, self.dtype)
        layers = attention_layers(self.model)
        if layers and self.device.type == "cuda":  # long chunks' dense attention
            peak += workspace_bytes(layers[0].num_heads, layers[0].num_kv_heads,
                                    layers[0].head_dim, sc.max_num_batched_tokens,
                                    self.dtype.itemsize)
        # The KV cache of this rank: its stage's layers, its KV heads.
        self.kv_arch = dataclasses.replace(self.arch, num_layers=len(layers),
                                           num_kv_heads=layers[0].num_kv_heads)
        # fp8: per-layer K/V scales from one calibration forward, fixed here, before CUDA
        # graphs capture them.
        scales = [(1.0, 1.0)] * len(layers)
        if config.cache.kv_cache_dtype == "fp8_e4m3":
            scales = calibrate_kv_scales(self.model, self.arch.vocab_size, sc.max_model_len,
                                         self.device, forward=self.forward_stages)
        # A draft model's cache holds as many tokens as the target's, within the same budget.
        draft_bytes = getattr(self.proposer, "kv_bytes_per_block", None)
        extra = draft_bytes(self.block_size) if draft_bytes is not None else 0
        # Every rank holds the same blocks (the scheduler has one pool): as many as the
        # tightest rank fits.
        self.num_blocks = self.layout.world.min(num_blocks_for(
            self.kv_arch, config.cache, self.kv_dtype, self.device, sc.max_model_len,
            sc.max_num_seqs, peak, extra))
        if extra and self.proposer.num_blocks is None:
            self.proposer.num_blocks = self.num_blocks
        # Running requests at most: given, or (max_num_seqs "auto") chosen now that the cache
        # is sized; the engine core's scheduler takes this value.
        self.max_num_seqs = sc.max_num_seqs
        if sc.max_num_seqs_auto:
            self.max_num_seqs, why = auto_max_num_seqs(self.num_blocks * self.block_size,
                                                       sc.max_model_len, sc.max_num_seqs)
            log.info("max_num_seqs %d (auto: %s; --max-num-seqs N sets it)", self.max_num_seqs,
                     why)
        # One block past the pool's: scratch space for CUDA-graph padding rows.
        self.kv_caches = allocate_kv_cache(
            self.kv_arch, self.num_blocks + 1, self.block_size, self.kv_dtype, self.device
        )
        for layer, cache, (k_scale, v_scale) in zip(layers, self.kv_caches, scales, strict=True):
            layer.kv_cache = cache
            layer.k_scale, layer.v_scale = k_scale, v_scale
        self.kv_cache_bytes = self.num_blocks * bytes_per_block(
            self.kv_arch, self.block_size, self.kv_dtype
        )
        # KV beyond the device (worker/connector/): started at launch, polled at each output;
        # each rank's over its own shard of the cache.
        lay = self.layout
        self.connector = make_connector(config, self.kv_caches, scales, {
            "tp_rank": lay.tp.index, "tp_size": lay.tp.size, "pp_rank": lay.stage_index,
            "pp_size": lay.num_stages})
        self.startup.add("kv_cache", time.perf_counter() - t0)
        self._in_flight: InFlight | None = None
        # Seconds the host has waited for sampled tokens: near zero when the host, not the
        # device, sets the pace of the steps.
        self.device_wait_s = 0.0
        # Seconds of the runner's own host work by phase (the request states, the step's
        # inputs, reading sampled tokens: bench/host_overhead.py); a few clock reads a step.
        self.host_s = {"states": 0.0, "inputs": 0.0, "read_tokens": 0.0}
        self.cpu_threads = torch.get_num_threads()  # as configured (--threads)
        self.step_threads = StepThreads(self.cpu_threads, envs.ENV.cpu_serial_tokens)
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            t0 = time.perf_counter()
            # verification steps: each request's last token and up to k drafts
            max_q = 1 + config.spec.num_speculative_tokens if self.proposer is not None else 1
            max_batch = min(self.max_num_seqs, MAX_GRAPH_BATCH)
            # mixed steps need the Triton attention (the references read the host lists)
            mixed = mixed_sizes(max(bucket_sizes(max_batch)), sc.max_num_batched_tokens) \
                if triton is not None else []
            self.graphs = CudaGraphRunner(
                self.model, max_batch, -(-sc.max_model_len // self.block_size),
                self.block_size, self.num_blocks, self.device, max_q,
                None if self.layout.first else (self.arch.hidden_size, self.dtype), mixed)
            self.graphs.capture(self.triton_compiles)
            self.graph_capture_seconds = time.perf_counter() - t0
            self.startup.add("cuda_graphs", self.graph_capture_seconds)
            times = self.graphs.capture_times
            log.info("captured %d CUDA graphs (%d of mixed steps) in %.1f s (warm-up %.1f s, of "
                     "which %d Triton compilations %.1f s; capture %.1f s)",
                     len(self.graphs.graphs), self.graphs.num_mixed, self.graph_capture_seconds,
                     sum(g.warmup_s for g in times), sum(g.triton_compiles for g in times),
                     sum(g.triton_s for g in times), sum(g.capture_s for g in times))
        if self.device.type == "cuda" and triton is not None:
            with self.startup.phase("eager_warmup"):
                warm_eager_steps(self)
        # Unseeded draws start from the seed whatever start-up drew (the same stream on every
        # layout of one kind of device).
        torch.manual_seed(config.model.seed)

    def _stage_input(self, ids: torch.Tensor) -> torch.Tensor:
        """What this stage's forward takes for a step of tokens `ids`: the ids on the first
        stage, random hidden states (profiling) on a later one."""
        if self.layout.first:
            return ids
        return torch.randn(ids.shape[0], self.arch.hidden_size, dtype=self.dtype,
                           device=self.device)

    @torch.inference_mode()
    def _profile(self) -> int:
        """Peak activation memory of the largest step: a forward over the full token budget."""
        sc = self.config.scheduler
        n = min(sc.max_num_batched_tokens, sc.max_model_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.randint(0, self.arch.vocab_size, (n,), device=self.device)
        hidden = self.model(self._stage_input(ids), torch.arange(n, device=self.device))
        rows = min(sc.max_num_seqs, n)
        if self.layout.last:
            logits = self.model.compute_logits(hidden[:rows])
            if logits is not None:
                logits.softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del ids, hidden
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def forward_stages(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A forward outside the KV cache through every stage (every rank calls it with the same
        tokens): the final hidden states [n, hidden] on the last stage, None on the others."""
        pipe = self.layout.pipe
        x = ids
        if not self.layout.first:
            x = pipe.recv((ids.shape[0], self.arch.hidden_size), self.dtype, self.device,
                          pipe.index - 1).wait()
        hidden = self.model(x, positions)
        if self.layout.last:
            return hidden
        pipe.send(hidden, pipe.index + 1).wait()
        return None

    def shutdown(self) -> None:
        """Stop the connector and let go of the device memory this runner holds (CUDA graphs
        and their pools, the KV cache, the weights): an engine that was shut down holds none
        even while something still references it (a benchmark's next engine in the same
        process sizes its KV cache from the memory free then)."""
        if self.connector is not None:
            self.connector.shutdown()
        self._in_flight = None
        self.graphs = None
        if envs.ENV.unfuse != self.unfuse_at_start:
            envs.ENV = dataclasses.replace(envs.ENV, unfuse=self.unfuse_at_start)
        if self.model is not None:
            for layer in attention_layers(self.model):
                layer.kv_cache = None
        self.kv_caches = []
        self.proposer = None
        self.model = None  # type: ignore[assignment]
        gc.collect()  # whatever of it sits in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
