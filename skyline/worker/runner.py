"""The model runner: owns the model, the KV cache and per-request token state on one device.

A step is launched (`launch`) and later collected (`collect`). With async scheduling the
engine launches step n+1 before collecting step n: `launch` queues n+1's forward pass on the
device, then waits for step n's tokens (the device is busy with n+1 meanwhile), records them,
and queues n+1's sampling; it hands step n's output back. Sampling comes after the wait so
penalties and seeded draws see every earlier token. Without async scheduling (or with
speculative decoding, whose verification needs the tokens at once) a step is launched and
collected in turn, as `execute` does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from skyline import envs
from skyline.config import EngineConfig
from skyline.model.forward_ctx import forward_context
from skyline.model.loader import load_model, prepack_for_cpu
from skyline.types import RunnerOutput, SchedulerOutput, TokenLogprobs
from skyline.worker.connector import make_connector
from skyline.worker.cuda_graph import MAX_GRAPH_BATCH, CudaGraphRunner
from skyline.worker.inputs import RequestState, StepInputs, build_inputs
from skyline.worker.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    calibrate_kv_scales,
    kv_cache_dtype,
    num_blocks_for,
)
from skyline.worker.sampler import DeviceSample, SamplingRow, prompt_logprobs, sample_on_device
from skyline.worker.spec.proposer import HiddenStateProposer, make_proposer
from skyline.worker.spec.verify import sample_and_verify, verify_rows

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU: a step of at most this many tokens runs on one thread. Its operations are too small to
# share well, and in a server the API process needs a core for every token it streams: an
# engine thread waiting for that core stalls each parallel region (BENCHMARKS.md, "Threads of
# a CPU server"; SKYLINE_CPU_SERIAL_TOKENS=0 turns this off).
CPU_SERIAL_TOKENS = envs.ENV.cpu_serial_tokens
# A step with nothing to compute (requests only wait for KV transfers) waits this long at most
# for one to end: the loop neither spins nor keeps new requests waiting.
KV_WAIT_S = 0.005


@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read yet."""

    req_ids: list[str]
    sampling_req_ids: list[str]
    propose: bool = True  # draft for the next step (SchedulerOutput.propose_drafts)
    sample: DeviceSample | None = None  # None: nothing sampled, or `result` already known
    result: RunnerOutput | None = None
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.model.dtype]
        self.arch = config.model.arch
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        torch.manual_seed(config.model.seed)
        self.model = load_model(config.model, self.device)
        if self.device.type == "cpu":
            prepack_for_cpu(self.model)  # oneDNN-packed Linears: cheap few-row products
        self.load_seconds = time.perf_counter() - t0
        self.states: dict[str, RequestState] = {}
        self._scoring: set[str] = set()  # requests whose prompt logprobs are still to compute
        # None without speculative decoding
        self.proposer = make_proposer(config.spec, self.model)
        self.eos_ids: tuple[int, ...] = self.arch.eos_token_ids
        peak = self._profile() if self.device.type == "cuda" else 0
        sc = config.scheduler
        self.kv_dtype = kv_cache_dtype(config.cache, self.dtype)
        # fp8: per-layer K/V scales from one calibration forward, fixed here, before CUDA
        # graphs capture them.
        layers = self.model.attention_layers()
        scales = [(1.0, 1.0)] * len(layers)
        if config.cache.kv_cache_dtype == "fp8_e4m3":
            scales = calibrate_kv_scales(self.model, self.arch.vocab_size, sc.max_model_len,
                                         self.device)
        # A draft model's cache holds as many tokens as the target's, within the same budget.
        draft_bytes = getattr(self.proposer, "kv_bytes_per_block", None)
        extra = draft_bytes(self.block_size) if draft_bytes is not None else 0
        self.num_blocks = num_blocks_for(self.arch, config.cache, self.kv_dtype, self.device,
                                         sc.max_model_len, sc.max_num_seqs, peak, extra)
        if extra and self.proposer.num_blocks is None:
            self.proposer.num_blocks = self.num_blocks
        # One block past the pool's: scratch space for CUDA-graph padding rows.
        self.kv_caches = allocate_kv_cache(
            self.arch, self.num_blocks + 1, self.block_size, self.kv_dtype, self.device
        )
        for layer, cache, (k_scale, v_scale) in zip(layers, self.kv_caches, scales, strict=True):
            layer.kv_cache = cache
            layer.k_scale, layer.v_scale = k_scale, v_scale
        self.kv_cache_bytes = self.num_blocks * bytes_per_block(
            self.arch, self.block_size, self.kv_dtype
        )
        # KV beyond the device (worker/connector/): started at launch, polled at each output.
        self.connector = make_connector(config, self.kv_caches, scales)
        self._in_flight: _InFlight | None = None
        # Seconds the host has waited for sampled tokens: near zero when the host, not the
        # device, sets the pace of the steps.
        self.device_wait_s = 0.0
        # Seconds of the runner's own host work by phase (the request states, the step's
        # inputs, reading sampled tokens: bench/host_overhead.py); a few clock reads a step.
        self.host_s = {"states": 0.0, "inputs": 0.0, "read_tokens": 0.0}
        self.cpu_threads = torch.get_num_threads()  # as configured (--threads)
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            t0 = time.perf_counter()
            # verification steps: each request's last token and up to k drafts
            max_q = 1 + config.spec.num_speculative_tokens if self.proposer is not None else 1
            self.graphs = CudaGraphRunner(
                self.model, min(sc.max_num_seqs, MAX_GRAPH_BATCH),
                -(-sc.max_model_len // self.block_size),
                self.block_size, self.num_blocks, self.device, max_q)
            self.graphs.capture()
            self.graph_capture_seconds = time.perf_counter() - t0
            log.info("captured %d CUDA graphs in %.1f s", len(self.graphs.graphs),
                     self.graph_capture_seconds)

    @torch.inference_mode()
    def _profile(self) -> int:
        """Peak activation memory of the largest step: a forward over the full token budget."""
        sc = self.config.scheduler
        n = min(sc.max_num_batched_tokens, sc.max_model_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.randint(0, self.arch.vocab_size, (n,), device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device))
        rows = min(sc.max_num_seqs, n)
        self.model.compute_logits(hidden[:rows]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del ids, hidden
        torch.cuda.empty_cache()
        return peak

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            state = self.states.pop(rid, None)
            self._scoring.discard(rid)
            if state is not None and self.proposer is not None:
                self.proposer.finish(rid, state.token_ids)
        for new in out.new_requests:
            self.states[new.request_id] = RequestState.from_new(new)
            # A request resumed with output tokens had its whole prompt scored before.
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                self._scoring.add(new.request_id)
        for c in out.cached_requests:
            s = self.states[c.request_id]
            if c.num_freed_blocks:
                del s.block_ids[-c.num_freed_blocks :]
            s.block_ids.extend(c.new_block_ids)
            s.num_computed_tokens = c.num_computed_tokens

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> RunnerOutput | None:
        """Queue a step on the device. If a step was in flight, wait for its tokens (after this
        step's forward pass is queued) and return its output."""
        t0 = time.perf_counter()
        self._update_states(out)
        if out.kv_transfers:
            assert self.connector is not None
            self.connector.start(out.kv_transfers)  # before this step's forward pass
        t1 = time.perf_counter()
        self.host_s["states"] += t1 - t0
        prev, self._in_flight = self._in_flight, None
        if out.empty:  # nothing to run: nothing in flight afterwards
            return self._finish(prev) if prev is not None else None
        if not out.total_num_scheduled_tokens:  # only KV transfers: report them
            if self.connector is not None and (prev is None or not prev.req_ids):
                self.connector.wait(KV_WAIT_S)  # nothing on the device to overlap with
            self._in_flight = _InFlight([], [], out.propose_drafts)
            return self._finish(prev) if prev is not None else None
        in_flight = None
        if prev is not None and prev.sample is not None:
            in_flight = ({r: i for i, r in enumerate(prev.sampling_req_ids)}, prev.sample.tokens)
        inp = build_inputs(self.states, out.num_scheduled_tokens, self.block_size, self.device,
                           out.spec_token_ids, in_flight)
        self.host_s["inputs"] += time.perf_counter() - t1
        serial = (self.device.type == "cpu" and self.cpu_threads > 1
                  and inp.input_ids.shape[0] <= CPU_SERIAL_TOKENS)
        if serial:  # restored below: the process's other torch work keeps its threads
            torch.set_num_threads(1)
        try:
            return self._launch(out, inp, prev)
        finally:
            if serial:
                torch.set_num_threads(self.cpu_threads)

    def _launch(self, out: SchedulerOutput, inp: StepInputs, prev: _InFlight | None
                ) -> RunnerOutput | None:
        shape = self.graphs.shape_for(inp) if self.graphs is not None else None
        if shape is not None:
            hidden = self.graphs.run(inp, shape)  # [num_tokens, hidden]
        else:
            with forward_context(inp.attn):
                hidden = self.model(inp.input_ids, inp.positions)  # [num_tokens, hidden]
        for rid in inp.req_ids:
            self.states[rid].num_computed_tokens += out.num_scheduled_tokens[rid]
        if isinstance(self.proposer, HiddenStateProposer) and out.feed_proposer:
            self._observe(inp.req_ids, inp.attn.query_start_loc, hidden)
        logits = None
        if inp.sampling_req_ids:
            logits = self.model.compute_logits(hidden[inp.logits_indices])  # [num_logits, vocab]
        prev_out = self._finish(prev) if prev is not None else None
        step = _InFlight(inp.req_ids, inp.sampling_req_ids, out.propose_drafts,
                         prompt_logprobs=self._prompt_logprobs(inp, hidden))
        if logits is not None:
            if out.spec_token_ids or out.token_masks:
                sampled, logprobs = self._sample(out, inp.sampling_req_ids, logits)
                step.result = self._output(inp.req_ids, sampled, logprobs, step.propose,
                                           step.prompt_logprobs)
            else:
                rows = [self._sampling_row(self.states[r]) for r in inp.sampling_req_ids]
                step.sample = sample_on_device(logits, rows)
                step.sample.copy_to_host()
        self._in_flight = step
        return prev_out

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]] | None:
        """Logprobs of the prompt tokens this step's prefill rows predict, for the requests
        that ask for them (called after `num_computed_tokens` counted the step's tokens)."""
        if not self._scoring:
            return None
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        loc = inp.attn.query_start_loc
        for i, rid in enumerate(inp.req_ids):
            if rid not in self._scoring:
                continue
            s = self.states[rid]
            n = loc[i + 1] - loc[i]
            start = s.num_computed_tokens - n  # the row at position p predicts token p + 1
            end = min(start + n, len(s.prompt_token_ids) - 1)
            if end > start:
                out[rid] = (start + 1, prompt_logprobs(
                    self.model.compute_logits, hidden[loc[i] : loc[i] + end - start],
                    s.prompt_token_ids[start + 1 : end + 1], s.params.prompt_logprobs or 0))
            if end >= len(s.prompt_token_ids) - 1:
                self._scoring.discard(rid)
        return out or None

    def _sampling_row(self, s: RequestState) -> SamplingRow:
        """The request's row for the sampler, made once: it holds the state's own token lists,
        which grow in place."""
        if s.sampling_row is None:
            s.sampling_row = SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids,
                                         self.eos_ids + tuple(s.params.stop_token_ids))
        return s.sampling_row

    def collect(self) -> RunnerOutput:
        """Wait for the step in flight and return its output."""
        step, self._in_flight = self._in_flight, None
        assert step is not None, "no step in flight"
        return self._finish(step)

    def _finish(self, step: _InFlight) -> RunnerOutput:
        t0 = time.perf_counter()
        try:
            res = self._read_tokens(step)
        finally:
            self.host_s["read_tokens"] += time.perf_counter() - t0
        if self.connector is not None:
            res.kv_finished, res.kv_failed = self.connector.poll()
        return res

    def _read_tokens(self, step: _InFlight) -> RunnerOutput:
        if step.result is not None:
            return step.result
        if step.sample is None:
            return self._output(step.req_ids, {}, {}, step.propose, step.prompt_logprobs)
        t = time.perf_counter()
        tokens, lps = step.sample.to_host()
        self.device_wait_s += time.perf_counter() - t
        sampled: dict[str, list[int]] = {}
        for rid, t in zip(step.sampling_req_ids, tokens, strict=True):
            state = self.states.get(rid)  # gone if it finished or was preempted meanwhile
            if state is not None:
                state.append(t)
            sampled[rid] = [t]
        logprobs = ({r: [lp] if lp is not None else None
                     for r, lp in zip(step.sampling_req_ids, lps, strict=True)}
                    if any(lp is not None for lp in lps) else {})
        return self._output(step.req_ids, sampled, logprobs, step.propose, step.prompt_logprobs)

    def _output(self, req_ids: list[str], sampled: dict[str, list[int]],
                logprobs: dict[str, list[TokenLogprobs] | None], propose: bool,
                prompt_lps: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
                ) -> RunnerOutput:
        return RunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=[logprobs.get(r) for r in req_ids],
            draft_token_ids=self._propose(req_ids, sampled, propose),
            prompt_logprobs=prompt_lps or {},
        )

    def _sample(
        self, out: SchedulerOutput, req_ids: list[str], logits: torch.Tensor
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs] | None]]:
        """Sample each request's next token, or verify its drafts (spec/verify.py): a request
        with k drafts has k + 1 logits rows and emits its accepted drafts and one more token."""
        states = [self.states[r] for r in req_ids]
        drafts = [out.spec_token_ids.get(r, []) for r in req_ids]
        stops = [self.eos_ids + tuple(s.params.stop_token_ids) for s in states]
        masks = [out.token_masks.get(r) for r in req_ids] if out.token_masks else ()
        tokens, lps = sample_and_verify(logits, verify_rows(states, drafts, stops), drafts, masks)
        for s, d, toks in zip(states, drafts, tokens, strict=True):
            for t in toks:
                s.append(t)
            s.num_computed_tokens -= len(d) + 1 - len(toks)  # rejected drafts hold no KV
        return dict(zip(req_ids, tokens, strict=True)), dict(zip(req_ids, lps, strict=True))

    def _observe(self, req_ids: list[str], loc: list[int], hidden: torch.Tensor) -> None:
        """Hand a hidden-state proposer (EAGLE) the step's hidden states, request by request
        (called after `num_computed_tokens` counted the step's tokens)."""
        assert isinstance(self.proposer, HiddenStateProposer)
        states = [self.states[r] for r in req_ids]
        rows = [hidden[loc[i] : loc[i + 1]] for i in range(len(req_ids))]
        starts = [s.num_computed_tokens - (loc[i + 1] - loc[i]) for i, s in enumerate(states)]
        self.proposer.observe(req_ids, starts, rows, [s.token_ids for s in states])

    def _propose(self, req_ids: list[str], sampled: dict[str, list[int]],
                 propose: bool = True) -> list[list[int]]:
        """Drafts to follow each request that just sampled (runs after sampling: the n-gram and
        suffix proposers need only token ids). When the next step will not verify drafts
        (`propose` false), the proposer is called with depth 0: it keeps its indexes and caches
        current and drafts nothing."""
        if self.proposer is None or not sampled:
            return []
        # With async scheduling, a request of the step just read may have finished meanwhile.
        rids = [r for r in req_ids if sampled.get(r) and r in self.states]
        depth = self.config.spec.num_speculative_tokens if propose else 0
        drafts = self.proposer.propose(rids, [self.states[r].token_ids for r in rids], depth)
        by_id = dict(zip(rids, drafts, strict=True))
        return [by_id.get(r, []) for r in req_ids]

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
