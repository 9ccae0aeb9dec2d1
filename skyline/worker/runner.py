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
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from skyline import envs
from skyline.config import EngineConfig
from skyline.model.forward_ctx import forward_context
from skyline.model.loader import load_model, prepack_for_cpu, prepack_host_experts
from skyline.model.partition import attention_layers
from skyline.parallel.groups import ParallelLayout
from skyline.types import RunnerOutput, SchedulerOutput, TokenLogprobs
from skyline.worker.connector import make_connector
from skyline.worker.cuda_graph import MAX_GRAPH_BATCH, CudaGraphRunner, auto_max_num_seqs
from skyline.worker.inputs import RequestState, StepInputs, build_inputs
from skyline.worker.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    calibrate_kv_scales,
    kv_cache_dtype,
    num_blocks_for,
)
from skyline.worker.memory import check_memory
from skyline.worker.sampler import (
    PROMPT_LOGPROB_ROWS,
    SamplingRow,
    prompt_logprobs,
    sample_on_device,
)
from skyline.worker.spec.proposer import HiddenStateProposer, make_proposer
from skyline.worker.spec.verify import sample_and_verify, verify_rows
from skyline.worker.step import InFlight, Part, split_parts

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


class ModelRunner:
    def __init__(self, config: EngineConfig, layout: ParallelLayout | None = None) -> None:
        self.config = config
        self.layout = layout or ParallelLayout.single(config.model.arch.num_layers,
                                                      config.device, config.parallel.n_cpu_moe)
        self.device = torch.device(self.layout.stage.device if layout else config.device)
        self.dtype = DTYPES[config.model.dtype]
        self.arch = config.model.arch
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        torch.manual_seed(config.model.seed)
        if layout is None or layout.world_size == 1:  # a rank holds its own part only
            check_memory(config, self.device)  # one sentence, not the out-of-memory killer
        self.model = load_model(config.model, self.device, self.layout)
        if self.device.type == "cpu":
            prepack_for_cpu(self.model)  # oneDNN-packed Linears: cheap few-row products
        else:
            prepack_host_experts(self.model, self.dtype)  # --n-cpu-moe: the CPU's layout
        self.load_seconds = time.perf_counter() - t0
        self.states: dict[str, RequestState] = {}
        self._scoring: set[str] = set()  # requests whose prompt logprobs are still to compute
        # None without speculative decoding
        self.proposer = make_proposer(config.spec, self.model)
        self.eos_ids: tuple[int, ...] = self.arch.eos_token_ids
        peak = self._profile() if self.device.type == "cuda" else 0
        self.profile_peak_bytes = peak
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
        self._in_flight: InFlight | None = None
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
                self.model, min(self.max_num_seqs, MAX_GRAPH_BATCH),
                -(-sc.max_model_len // self.block_size),
                self.block_size, self.num_blocks, self.device, max_q,
                None if self.layout.first else (self.arch.hidden_size, self.dtype))
            self.graphs.capture()
            self.graph_capture_seconds = time.perf_counter() - t0
            log.info("captured %d CUDA graphs in %.1f s", len(self.graphs.graphs),
                     self.graph_capture_seconds)
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
            self._in_flight = InFlight(propose=out.propose_drafts)
            return self._finish(prev) if prev is not None else None
        serial = (self.device.type == "cpu" and self.cpu_threads > 1
                  and out.total_num_scheduled_tokens <= CPU_SERIAL_TOKENS)
        if serial:  # restored below: the process's other torch work keeps its threads
            torch.set_num_threads(1)
        try:
            return self._launch(out, prev)
        finally:
            if serial:
                torch.set_num_threads(self.cpu_threads)

    def _launch(self, out: SchedulerOutput, prev: InFlight | None) -> RunnerOutput | None:
        layout = self.layout
        step = InFlight(propose=out.propose_drafts)
        prev_out = None
        for scheduled in split_parts(out.num_scheduled_tokens, layout.num_stages):
            in_flight = prev.tokens_for(self.states, scheduled) \
                if prev is not None and layout.first else None
            t1 = time.perf_counter()
            inp = build_inputs(self.states, scheduled, self.block_size, self.device,
                               out.spec_token_ids, in_flight, with_ids=layout.first)
            self.host_s["inputs"] += time.perf_counter() - t1
            part = Part(inp.req_ids, inp.sampling_req_ids)
            step.parts.append(part)
            hidden = self._forward(inp)  # [num_tokens, hidden]
            for rid in inp.req_ids:
                self.states[rid].num_computed_tokens += scheduled[rid]
            if isinstance(self.proposer, HiddenStateProposer) and out.feed_proposer:
                self._observe(inp.req_ids, inp.attn.query_start_loc, hidden)
            if not layout.last:
                if self.graphs is not None:  # a graph's output: its next replay writes it
                    hidden = hidden.clone()
                part.transfers.append(layout.pipe.send(hidden, layout.pipe.index + 1))
            else:
                if self._scoring:
                    step.add_prompt_logprobs(self._prompt_logprobs(inp, hidden))
                if inp.sampling_req_ids:
                    # [num_logits, vocab] on the driver; None on its tensor-parallel peers
                    logits = self.model.compute_logits(hidden[inp.logits_indices])
                    if layout.driver:
                        if prev is not None:  # sampling sees every earlier token
                            prev_out, prev = self._finish(prev), None
                        self._sample_part(out, part, logits)
            if layout.needs_tokens and inp.sampling_req_ids:
                buf = torch.empty(len(inp.sampling_req_ids), dtype=torch.int64,
                                  device=self.device)
                part.tokens = layout.tokens.broadcast(buf, src=0)
        if prev is not None:
            prev_out = self._finish(prev)
        self._in_flight = step
        return prev_out

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        """This stage's forward over a step's tokens (a later stage's input comes from the
        previous stage)."""
        if not self.layout.first:
            pipe = self.layout.pipe
            shape = (inp.positions.shape[0], self.arch.hidden_size)
            inp.input_ids = pipe.recv(shape, self.dtype, self.device, pipe.index - 1).wait()
        shape = self.graphs.shape_for(inp) if self.graphs is not None else None
        if shape is not None:
            return self.graphs.run(inp, shape)
        with forward_context(inp.attn):
            return self.model(inp.input_ids, inp.positions)

    def _sample_part(self, out: SchedulerOutput, part: Part, logits: torch.Tensor) -> None:
        """The driver's draw for a part; the first stage's other ranks get a copy."""
        if out.spec_token_ids or out.token_masks:
            part.result = self._sample(out, part.sampling_req_ids, logits)
            tokens = None
            if self.layout.tokens.size > 1:
                tokens = torch.tensor([t[-1] for t in part.result[0].values()],
                                      dtype=torch.int64, device=self.device)
        else:
            rows = [self._sampling_row(self.states[r]) for r in part.sampling_req_ids]
            part.sample = sample_on_device(logits, rows)
            part.sample.copy_to_host()
            tokens = part.sample.tokens
        if tokens is not None and self.layout.tokens.size > 1:
            part.transfers.append(self.layout.tokens.broadcast(tokens, src=0))

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]] | None:
        """Logprobs of the prompt tokens this part's prefill rows predict, for the requests
        that ask for them (called on the last stage after `num_computed_tokens` counted the
        part's tokens; the driver's tensor-parallel peers take part in the logits, then drop
        what they computed)."""
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
                rows = hidden[loc[i] : loc[i] + end - start]
                if self.layout.driver:
                    out[rid] = (start + 1, prompt_logprobs(
                        self.model.compute_logits, rows,
                        s.prompt_token_ids[start + 1 : end + 1], s.params.prompt_logprobs or 0))
                else:  # the same chunks as the driver's: its gathers need every peer
                    for c in range(0, end - start, PROMPT_LOGPROB_ROWS):
                        self.model.compute_logits(rows[c : c + PROMPT_LOGPROB_ROWS])
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

    def _finish(self, step: InFlight) -> RunnerOutput:
        t0 = time.perf_counter()
        try:
            res = self._read_tokens(step)
        finally:
            self.host_s["read_tokens"] += time.perf_counter() - t0
        if self.connector is not None:
            res.kv_finished, res.kv_failed = self.connector.poll()
        return res

    def _read_tokens(self, step: InFlight) -> RunnerOutput:
        """Read a step's tokens and record them. Ranks that hold no tokens (a later stage's,
        the driver's tensor-parallel peers) record a placeholder for each: a request's token
        count is what decides whether it samples."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs] | None] = {}
        for part in step.parts:
            for transfer in part.transfers:
                transfer.wait()
            if part.result is not None:  # verified or constrained: recorded already
                sampled.update(part.result[0])
                logprobs.update(part.result[1])
                continue
            if not part.sampling_req_ids:
                continue
            lps: list[TokenLogprobs | None] = []
            t = time.perf_counter()
            if part.sample is not None:
                tokens, lps = part.sample.to_host()
            elif part.tokens is not None:
                tokens = part.tokens.wait().tolist()
            else:
                tokens = [-1] * len(part.sampling_req_ids)
            self.device_wait_s += time.perf_counter() - t
            for rid, tok in zip(part.sampling_req_ids, tokens, strict=True):
                state = self.states.get(rid)  # gone if it finished or was preempted meanwhile
                if state is not None:
                    state.append(tok)
                sampled[rid] = [tok]
            if any(lp is not None for lp in lps):
                logprobs.update((r, [lp] if lp is not None else None)
                                for r, lp in zip(part.sampling_req_ids, lps, strict=True))
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
        """Stop the connector and let go of the device memory this runner holds (CUDA graphs
        and their pools, the KV cache, the weights): an engine that was shut down holds none
        even while something still references it (a benchmark's next engine in the same
        process sizes its KV cache from the memory free then)."""
        if self.connector is not None:
            self.connector.shutdown()
        self._in_flight = None
        self.graphs = None
        if self.model is not None:
            for layer in attention_layers(self.model):
                layer.kv_cache = None
        self.kv_caches = []
        self.proposer = None
        self.model = None  # type: ignore[assignment]
        gc.collect()  # whatever of it sits in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
