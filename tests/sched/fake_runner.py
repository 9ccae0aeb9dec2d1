"""A model-free runner that keeps the scheduler honest.

It tracks requests only from what `SchedulerOutput` tells it (new requests whole, known ones as
diffs), simulates a paged KV cache whose slots hold a digest of the whole prefix up to each
position (like real KV, which depends on every earlier token), and before computing a step it
reads back every earlier position through the block table. A prefix hit on a block not yet
written, a block shared and then overwritten, or a wrong block table all fail loudly. The next
token is a deterministic function of the tokens read back.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from skyline.sched.scheduler import Scheduler
from skyline.types import (
    KV_DROP,
    KV_LOAD,
    KV_SPILL,
    KV_STORE,
    KVTransfer,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    StepOutput,
)

VOCAB = 97


def next_token(tokens: Sequence[int]) -> int:
    a = tokens[-1]
    b = tokens[-2] if len(tokens) > 1 else 0
    return (31 * a + 7 * b + len(tokens)) % VOCAB


def reference(
    prompt: list[int],
    params: SamplingParams,
    max_len: int,
    eos: tuple[int, ...] = (),
) -> tuple[list[int], str, int | None]:
    """What a request must produce: (output ids, finish reason, stop reason)."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens:
            if not params.ignore_eos and t in eos:
                return out, "stop", None
            if t in params.stop_token_ids:
                return out, "stop", t
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out, "length", None
        if len(tokens) >= max_len:
            return out, "length", None


@dataclass
class _State:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    digests: list[int] = field(default_factory=list)

    def digest(self, pos: int) -> int:
        while len(self.digests) <= pos:
            p = len(self.digests)
            prev = self.digests[-1] if self.digests else 0
            self.digests.append(hash((prev, self.tokens[p])))
        return self.digests[pos]


Block = tuple[tuple[int, int] | None, ...]  # one block's slots


class FakeTiers:
    """The worker half of the KV tiers, on the fake cache: RAM slots and disk files hold copies
    of a block's slots. Copies that a real worker makes later (DMA, I/O threads) are made when
    the transfer is reported, `delay` steps after it started, so that a block or slot reused
    too early holds the wrong digests and the reads of `FakeRunner.execute` fail. Disk reads
    and writes fail with probability `fail`."""

    def __init__(self, runner: FakeRunner, rng: random.Random | None = None,
                 delay: int = 0, fail: float = 0.0) -> None:
        self.runner = runner
        self.rng = rng or random.Random(0)
        self.delay, self.fail = delay, fail
        self.ram: dict[int, Block] = {}
        self.disk: dict[bytes, Block] = {}
        self.pending: list[tuple[int, KVTransfer, set[int]]] = []  # due step, op, failed
        self.step = 0

    def read_block(self, block_id: int) -> Block:
        bs = self.runner.block_size
        return tuple(self.runner.slots.get((block_id, o)) for o in range(bs))

    def write_block(self, block_id: int, data: Block) -> None:
        for o, v in enumerate(data):
            if v is None:
                self.runner.slots.pop((block_id, o), None)
            else:
                self.runner.slots[(block_id, o)] = v

    def start(self, transfers: list[KVTransfer]) -> None:
        for t in sorted(transfers, key=lambda t: t.kind != KV_STORE):
            failed = set()
            if t.kind == KV_STORE:  # the gather: now, before the step writes
                for b, slot in zip(t.block_ids, t.ram_slots, strict=True):
                    data = self.read_block(b)
                    assert None not in data, f"block {b} stored before it was full"
                    self.ram[slot] = data
            if t.kind in (KV_STORE, KV_SPILL, KV_LOAD):
                failed = {i for i, d in enumerate(t.disk) if d and self.rng.random() < self.fail}
            self.pending.append((self.step + self.rng.randint(0, self.delay), t, failed))

    def poll(self, out: RunnerOutput) -> None:
        self.step += 1
        due = [p for p in self.pending if p[0] < self.step]
        self.pending = [p for p in self.pending if p[0] >= self.step]
        for _, t, failed in due:
            for i, key in enumerate(t.keys):
                if i in failed:
                    continue
                if t.kind == KV_LOAD:
                    data = self.disk[key] if t.disk[i] else self.ram[t.ram_slots[i]]
                    self.write_block(t.block_ids[i], data)
                elif t.kind in (KV_STORE, KV_SPILL) and t.disk[i]:
                    self.disk[key] = self.ram[t.ram_slots[i]]
                elif t.kind == KV_DROP:
                    self.disk.pop(key, None)
            out.kv_finished.append(t.op_id)
            if failed:
                out.kv_failed[t.op_id] = sorted(failed)


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (pos, digest)
        self.reqs: dict[str, _State] = {}
        self._in_flight: RunnerOutput | None = None
        self.tiers: FakeTiers | None = None

    def launch(self, so: SchedulerOutput) -> RunnerOutput | None:
        """Async scheduling: run `so` now (the fake device is instant and in order) and hand
        back the previous step's output, as the model runner does."""
        prev, self._in_flight = self._in_flight, None
        if not so.empty:
            self._in_flight = self.execute(so)
        elif so.finished_request_ids:
            self.execute(so)
        return prev

    def collect(self) -> RunnerOutput:
        out, self._in_flight = self._in_flight, None
        assert out is not None
        return out

    def _slot(self, st: _State, pos: int) -> tuple[int, int]:
        return st.block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        if so.kv_transfers:
            assert self.tiers is not None
            self.tiers.start(so.kv_transfers)
        for rid in so.finished_request_ids:
            self.reqs.pop(rid, None)
        for nr in so.new_requests:
            assert nr.request_id not in self.reqs, f"{nr.request_id} sent whole twice"
            self.reqs[nr.request_id] = _State(
                tokens=list(nr.prompt_token_ids) + list(nr.output_token_ids),
                block_ids=list(nr.block_ids),
                num_computed=nr.num_computed_tokens,
            )
        for cr in so.cached_requests:
            st = self.reqs[cr.request_id]
            assert st.num_computed == cr.num_computed_tokens, (cr, st.num_computed)
            st.block_ids += cr.new_block_ids
        assert len(so.new_requests) + len(so.cached_requests) == len(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        # One batched forward: every request reads its earlier positions before any request
        # writes, so a hit on a block computed in this same step reads garbage and fails.
        spans = {}
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, end = st.num_computed, st.num_computed + n
            assert n > 0 and end <= len(st.tokens), (rid, start, n, len(st.tokens))
            assert len(st.block_ids) * self.block_size >= end, "block table too short"
            assert len(set(st.block_ids)) == len(st.block_ids), "block twice in one table"
            for pos in range(start):  # attention reads every earlier position
                assert self.slots.get(self._slot(st, pos)) == (pos, st.digest(pos)), (
                    f"{rid}: stale or foreign KV at position {pos}"
                )
            spans[rid] = (start, end)
        out = RunnerOutput()
        for rid, (start, end) in spans.items():
            st = self.reqs[rid]
            for pos in range(start, end):
                self.slots[self._slot(st, pos)] = (pos, st.digest(pos))
            st.num_computed = end
            out.req_ids.append(rid)
            out.logprobs.append(None)
            if end == len(st.tokens):
                t = next_token(st.tokens)
                st.tokens.append(t)
                out.sampled_token_ids.append([t])
            else:
                out.sampled_token_ids.append([])
        if self.tiers is not None:
            self.tiers.poll(out)
        return out


def check_invariants(sched: Scheduler) -> None:
    """Block accounting between any two calls."""
    kv, pool = sched.kv_manager, sched.kv_manager.block_pool
    pool.check_invariants()
    loads = sched.kv_loads
    loading = {r.request_id for r in loads.loading.values()}
    held = {r.request_id for r in loads._held.values()}
    live = {r.request_id for r in sched.running} | loading | held
    assert set(kv._blocks) <= live, "a request that is not running holds blocks"
    for r in loads.loading.values():
        assert r.status.value == "waiting_for_kv" and r.request_id in sched.requests
    assert sum(b.ref_cnt for b in pool.blocks) == kv.num_held_blocks()
    holders: dict[int, int] = defaultdict(int)
    for rid in live:
        for b in kv.blocks(rid):
            holders[b.block_id] += 1
    for bid, n in holders.items():
        blk = pool.blocks[bid]
        assert blk.ref_cnt == n
        assert n == 1 or blk.block_hash is not None, f"block {bid} shared without a hash"
    for r in sched.running:
        assert len(kv.blocks(r.request_id)) * sched.block_size >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.num_computed_tokens == 0 and not kv.blocks(r.request_id)
    assert len(sched.running) <= sched.cfg.max_num_seqs
    assert set(sched.requests) == (live - held) | {r.request_id for r in sched.waiting}
    if loads.connector is not None:
        loads.connector.check_invariants()


def run(
    sched: Scheduler,
    runner: FakeRunner,
    max_steps: int = 10_000,
    check: bool = True,
    on_step=None,
) -> tuple[dict[str, list[int]], dict[str, StepOutput], int]:
    """Drive the loop until every request finished. Returns (outputs, last StepOutput, steps)."""
    outputs: dict[str, list[int]] = defaultdict(list)
    final: dict[str, StepOutput] = {}
    steps = 0
    while sched.has_unfinished():
        assert steps < max_steps, "no progress: deadlock or livelock"
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= sched.cfg.max_num_batched_tokens
        assert so.total_num_scheduled_tokens > 0 or so.kv_in_flight, (
            "unfinished requests but nothing scheduled")
        if check:
            check_invariants(sched)
        if on_step is not None:
            on_step(steps, so)
        for o in sched.update(so, runner.execute(so)):
            assert o.request_id not in final, "output after finishing"
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = o
        if check:
            check_invariants(sched)
        steps += 1
    return dict(outputs), final, steps
