"""A step through the model runner: `launch` queues one on the device and hands back the one
before, `collect` waits for the one in flight; between them the request states, the forward
pass stage by stage, sampling or verifying drafts, prompt logprobs and the next drafts."""

from __future__ import annotations

import time

import torch

from skyline import envs
from skyline.model.forward_ctx import forward_context
from skyline.types import RunnerOutput, SchedulerOutput, TokenLogprobs
from skyline.worker.inputs import RequestState, StepInputs, build_inputs
from skyline.worker.runner.startup import RunnerStartup
from skyline.worker.sampler import (
    PROMPT_LOGPROB_ROWS,
    SamplingRow,
    prompt_logprobs,
    sample_on_device,
)
from skyline.worker.spec.proposer import HiddenStateProposer
from skyline.worker.spec.verify import sample_and_verify, verify_rows
from skyline.worker.step import InFlight, Part, split_parts

# CPU: a step of at most this many tokens runs on one thread or on all of them, whichever its
# size ran faster on lately (runner/step_threads.py); SKYLINE_CPU_SERIAL_TOKENS=0: always all.
CPU_SERIAL_TOKENS = envs.ENV.cpu_serial_tokens
# A step with nothing to compute (requests only wait for KV transfers) waits this long at most
# for one to end: the loop neither spins nor keeps new requests waiting.
KV_WAIT_S = 0.005


class ModelRunner(RunnerStartup):
    """The model, its KV cache and per-request token state on one device (the package's
    docstring tells how a step flows)."""

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
        if self.device.type != "cpu":
            return self._launch(out, prev)
        tokens = out.total_num_scheduled_tokens
        threads = self.step_threads.choose(tokens)
        if threads != self.cpu_threads:  # restored below: other torch work keeps its threads
            torch.set_num_threads(threads)
        t2 = time.perf_counter()
        try:
            return self._launch(out, prev)
        finally:
            self.step_threads.record(tokens, threads, time.perf_counter() - t2)
            if threads != self.cpu_threads:
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
