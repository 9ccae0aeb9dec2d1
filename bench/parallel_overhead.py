"""What a step costs the multi-process executor, on the CPU: the same decode steps run by the
one-process executor, by one rank in a process of its own, and by two tensor-parallel ranks.

Each engine decodes BATCH running requests for STEPS timed steps of a model that computes
zeros at no cost (the "zero_forward" query on every rank: what remains is the engine's and the
executor's own work), or with --model default of the embedded SmolLM2-135M as it computes; a
row gives its median time per step, synchronous
(each step's tokens read before the next is scheduled) and with async scheduling (the engine
schedules step n + 1 while the ranks run step n: another process, so here it overlaps).
Separately it times the step message alone: the SchedulerOutputs of the one-process run
encoded (engine side) and decoded (rank side) by worker/executor/codec.py. One thread a
process; the best of interleaved rounds (the machine's load average is recorded).

    python bench/parallel_overhead.py --out bench/results/parallel/overhead-cpu.json
    python bench/parallel_overhead.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any

from skyline.bench.offline import machine_info, save_json
from skyline.engine.core import fewer_collections
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams, SchedulerOutput
from skyline.worker.executor.codec import StepEncoder, decode_step

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 2048,
        "max_position_embeddings": 1 << 16, "torch_dtype": "float32", "eos_token_id": 2}
LAYOUTS = [("uni", 1), ("mp", 1), ("mp", 2)]  # (executor, tensor-parallel size)


def engine(model: str | None, max_batch: int, context: int, steps: int, executor: str,
           tp: int) -> LLM:
    budget = max(2048, context)
    # room for the steps early requests decode while later ones prefill, and the timed ones
    # one thread a process: a shared machine's cores are not the engine's to spread over
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", max_num_seqs=max_batch, threads=1,
                              max_num_batched_tokens=budget, block_size=16,
                              max_model_len=context + steps + 64 + max_batch * context // budget,
                              distributed_executor=executor, tensor_parallel_size=tp)
    if model is None:
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(TINY, f)
        llm = LLM(d, load_format="dummy", kv_cache_memory=256 << 20, **kw)
        llm.query("zero_forward")
        return llm
    return LLM(None if model == "default" else model, kv_cache_memory=1 << 30, **kw)


def measure(llm: LLM, batch: int, context: int, steps: int, async_on: bool,
            record: list[SchedulerOutput] | None = None) -> float:
    """Seconds per decode step of `batch` running requests: the median step (this machine is
    shared; a mean counts other processes' bursts)."""
    llm.engine.async_scheduling = async_on  # the engine's switch, between runs
    vocab = llm.config.model.arch.vocab_size
    # to the context's end (the timed steps fit; early requests decode while others prefill)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    rids = [llm.add_request([100 + (i * 7 + j) % (vocab - 200) for j in range(context)], params)
            for i in range(batch)]
    sched = llm.engine.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        llm.step()  # everyone prefilled
    for _ in range(3):
        llm.step()
    schedule = sched.schedule
    if record is not None:
        def recorded() -> SchedulerOutput:
            out = schedule()
            record.append(out)
            return out

        sched.schedule = recorded
    times = []
    with fewer_collections():  # as LLM.generate runs its steps (the ranks: tune_gc)
        for _ in range(steps):
            t0 = time.perf_counter()
            llm.step(final_only=True)
            times.append(time.perf_counter() - t0)
    assert len(sched.running) == batch, "every request decodes through the timed steps"
    sched.schedule = schedule
    for rid in rids:
        llm.abort(rid)
    while llm.engine.has_unfinished():
        llm.step()
    return sorted(times)[len(times) // 2]


def message_us(outs: list[SchedulerOutput]) -> tuple[float, float, int]:
    """Microseconds to encode, and to decode, one step's message; its mean bytes."""
    enc = StepEncoder()
    t = time.perf_counter()
    data = [enc.encode(o) for o in outs]
    t_enc = time.perf_counter() - t
    t = time.perf_counter()
    for d in data:
        decode_step(d)
    t_dec = time.perf_counter() - t
    n = len(outs)
    return 1e6 * t_enc / n, 1e6 * t_dec / n, sum(len(d) for d in data) // n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: zeros; 'default' for the "
                    "embedded SmolLM2-135M")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 1000])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best kept")
    ap.add_argument("--smoke", action="store_true", help="tiny run (CI): batch 1 and 8, 4 steps")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.batch, a.context, a.steps, a.rounds = [1, 8], 8, 4, 1
    cases = [(b, async_on) for b in a.batch for async_on in (False, True)]
    rows: dict[tuple[int, bool], dict[str, Any]] = {
        c: {"batch": c[0], "async_scheduling": c[1]} for c in cases}
    # Every layout's engine stays up (idle ranks sleep) and the rounds interleave them, so a
    # burst of other work on this shared machine falls on all of them alike; a row keeps each
    # layout's best round.
    engines = {lay: engine(a.model, max(a.batch), a.context, a.steps, *lay) for lay in LAYOUTS}
    try:
        for _ in range(a.rounds):
            for batch, async_on in cases:
                row = rows[batch, async_on]
                for (executor, tp), llm in engines.items():
                    outs: list[SchedulerOutput] | None = [] if executor == "uni" else None
                    ms = 1e3 * measure(llm, batch, a.context, a.steps, async_on, outs)
                    key = f"{executor}_tp{tp}_ms"
                    row[key] = min(row.get(key, ms), ms)
                    if outs:
                        enc, dec, size = message_us(outs)
                        row["encode_us"] = min(row.get("encode_us", enc), enc)
                        row["decode_us"] = min(row.get("decode_us", dec), dec)
                        row["message_bytes"] = size
    finally:
        for llm in engines.values():
            llm.shutdown()
    for row in rows.values():
        row["mp_overhead_ms"] = row["mp_tp1_ms"] - row["uni_tp1_ms"]
        print(f"batch {row['batch']:5d} async {'on ' if row['async_scheduling'] else 'off'}: "
              f"one process {row['uni_tp1_ms']:7.2f} ms/step, one rank in its process "
              f"{row['mp_tp1_ms']:7.2f}, two ranks (TP=2) {row['mp_tp2_ms']:7.2f}; message "
              f"{row['message_bytes']} B, encode {row['encode_us']:.0f} us, decode "
              f"{row['decode_us']:.0f} us")
    save_json({"benchmark": "parallel_overhead",
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "model": a.model or "zeros (zero_forward)", "context": a.context,
               "steps": a.steps, "rounds": a.rounds, "machine": machine_info("cpu"),
               "load_average": os.getloadavg(),
               "command": "python bench/parallel_overhead.py " + " ".join(sys.argv[1:]),
               "rows": list(rows.values())}, a.out)


if __name__ == "__main__":
    main()
