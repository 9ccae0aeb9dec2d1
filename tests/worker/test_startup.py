"""Start-up is recorded by phase (the phases add up to the whole start), and CUDA-graph capture
warms each shape up with one eager forward, not two (bench/fast_start.py measures both)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from skyline.engine.frontend.llm import LLM
from skyline.model.forward_ctx import get_forward_context
from skyline.ops import triton_utils
from skyline.types.startup import StartupPhases, expand, format_phases, process_seconds
from skyline.worker import cuda_graph
from skyline.worker.cuda_graph import CudaGraphRunner, graph_shapes


def test_llm_start_phases_add_up_to_its_time(tiny_llama):
    path = tiny_llama()
    t0 = time.perf_counter()
    llm = LLM(path, device="cpu", kv_cache_memory="8MiB", max_model_len=256)
    wall = time.perf_counter() - t0
    try:
        phases = llm.startup
        assert list(phases)[:4] == ["config", "tokenizer", "load_weights", "speculator"]
        assert {"profile", "kv_cache", "engine_other"} <= set(phases)
        assert all(s >= 0 for s in phases.values())
        assert phases["load_weights"] > 0
        assert sum(phases.values()) == pytest.approx(wall, abs=0.05 + 0.05 * wall)
        info = llm.query("describe")
        assert info["startup"]["load_weights"] == info["load_seconds"]
        assert info["cuda_graph_times"] == [] and info["triton_compiles"] == 0
        assert set(info["startup"]) <= set(phases)
    finally:
        llm.shutdown()


def test_phase_record_expands_a_phase_in_place():
    p = StartupPhases()
    p.add("spawn", 1.0)
    with p.phase("engine"):
        pass
    p.add("engine", 5.0)
    p.add("serve", 0.5)
    out = expand(p.seconds, "engine", {"weights": 2.0, "graphs": 2.5})
    assert list(out) == ["spawn", "weights", "graphs", "engine_other", "serve"]
    assert out["engine_other"] == pytest.approx(0.5, abs=0.01)
    assert sum(out.values()) == pytest.approx(p.total)
    assert format_phases({"a": 1.234}) == "a 1.23 s"
    age = process_seconds()
    assert age is None or 0 < age < 3600


def test_triton_compiles_are_counted_through_its_hooks(monkeypatch):
    runtime = getattr(getattr(triton_utils.triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("no Triton with JIT hooks here")
    monkeypatch.setattr(triton_utils, "interpreted", lambda: False)  # as on a GPU
    seen = []
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = lambda **kw: seen.append(kw)  # someone else's hook: kept
    runtime.jit_post_compile_hook = None

    class Fn:
        name = "kernel_a"

    def compile_one(name: str = "kernel_a") -> None:  # what Triton's JIT calls around one
        assert not runtime.jit_cache_hook(key="k")
        runtime.jit_post_compile_hook(key=name, fn=Fn() if name == "kernel_a" else None)

    try:
        start = triton_utils.compiled_so_far()
        with triton_utils.count_compiles() as outer:
            compile_one()
            with triton_utils.count_compiles() as inner:
                compile_one()
                compile_one("kernel_b")
        compile_one()  # after the blocks: the process's count only
        assert (outer.num, inner.num) == (3, 2) and outer.seconds >= 0 and len(seen) == 4
        assert dict(inner.kernels) == {"kernel_a": 1, "kernel_b": 1}
        run = triton_utils.compiled_so_far().since(start)
        assert run.num == 4 and dict(run.kernels) == {"kernel_a": 3, "kernel_b": 1}
        with triton_utils.count_compiles():  # installed once: no second link in the chain
            compile_one()
        assert len(seen) == 5
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Graph:
    def pool(self) -> int:
        return 0


class _CountingModel:
    """Counts forwards, and whether each ran during a capture."""

    def __init__(self) -> None:
        self.capturing = False
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls.append((ids.shape[0], self.capturing))
        return torch.zeros(ids.shape[0], 4)


def test_capture_warms_each_shape_up_once(monkeypatch):
    model = _CountingModel()

    @contextlib.contextmanager
    def capture(graph: object, pool: object = None):
        model.capturing = True
        yield
        model.capturing = False

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", _Stream)
    monkeypatch.setattr(cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(cuda, "graph", capture)
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    runner = CudaGraphRunner(model, 32, 4, 16, 7, torch.device("cpu"), max_query_len=2)  # type: ignore[arg-type]
    runner.capture()
    shapes = graph_shapes(32, 2)
    assert len(runner.graphs) == len(shapes) == len(runner.capture_times)
    warmups = [n for n, capturing in model.calls if not capturing]
    captures = [n for n, capturing in model.calls if capturing]
    assert len(captures) == len(shapes)
    assert len(warmups) == cuda_graph.NUM_WARMUPS * len(shapes) == len(shapes)
    assert [(g.num_seqs, g.num_tokens, g.query_len) for g in runner.capture_times] == [
        tuple(s) for s in runner.graphs]
    assert all(g.warmup_s >= 0 and g.capture_s >= 0 for g in runner.capture_times)


class _SlotRecordingModel(_CountingModel):
    """Also records the slots and block ids each forward's attention would write and read."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: set[int] = set()
        self.blocks: set[int] = set()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        self.slots |= set(meta.slot_mapping.tolist())
        self.blocks |= set(meta.block_tables.flatten().tolist())
        return super().__call__(ids, positions)


def test_a_second_capture_touches_only_the_scratch_block(monkeypatch):
    # The unfuse query captures again after steps ran: the buffers still hold the last step's
    # slots and blocks, and a warm-up forward must neither write K/V there nor read there.
    model = _SlotRecordingModel()
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", _Stream)
    monkeypatch.setattr(cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    scratch = 7
    runner = CudaGraphRunner(model, 8, 4, 16, scratch, torch.device("cpu"),  # type: ignore[arg-type]
                             mixed_tokens=[32])
    runner.capture()
    num_shapes = len(runner.capture_times)
    runner.slot_mapping[:20] = torch.arange(20)  # a step's slots and blocks, as run() leaves
    runner.block_tables[:3, :2] = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    model.slots.clear()
    model.blocks.clear()
    runner.graphs.clear()
    runner.capture()
    assert model.blocks == {scratch}
    assert model.slots == set(range(scratch * 16, scratch * 16 + 1))
    assert len(runner.capture_times) == num_shapes == len(runner.graphs)  # this capture's only


def test_a_compilation_is_described_argument_by_argument():
    jit = pytest.importorskip("triton.runtime.jit")
    serialize = getattr(jit, "serialize_specialization_data", None)
    if serialize is None:
        pytest.skip("a Triton without serialize_specialization_data")
    options = type("Options", (), {})()
    options.__dict__.update(num_warps=4, num_stages=3, num_ctas=1)
    signature = {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    data = serialize("k", signature, {(2,): 64}, {(1,): [["tt.divisibility", 16]]}, options,
                     "key")
    spec = triton_utils._specialization({"specialization_data": data})
    assert spec == {"x_ptr": "*bf16", "n": 'i32 [["tt.divisibility", 16]]', "BLOCK": "64",
                    "num_warps": "4", "num_stages": "3", "num_ctas": "1"}
    assert triton_utils._specialization({}) == {}


@pytest.mark.parametrize("budget,seqs,max_len", [(8192, 256, 131072), (8192, 1024, 2048),
                                                 (2048, 1024, 4096), (512, 4, 300),
                                                 (1024, 1, 2048), (8192, 8, 1000)])
def test_eager_warm_up_reaches_every_bucket_a_step_can(budget, seqs, max_len):
    from skyline.ops.attention_config import batch_bucket
    from skyline.ops.tuning import token_bucket
    from skyline.worker.runner.warm import SHORT_PREFILL, _meta, warm_shapes

    shapes = warm_shapes(budget, seqs, max_len)
    for d, lens in shapes:
        assert d + sum(lens) <= budget and max(lens) <= max_len and d + len(lens) <= seqs
    # a step's total tokens (the norms', the Linears'), as far as its sequences can hold
    warmed_t = {token_bucket(d + sum(lens)) for d, lens in shapes}
    for t in range(2, min(budget, seqs * max_len) + 1):
        assert token_bucket(t) in warmed_t, t
    # a prompt chunk's tokens (prefill attention's)
    warmed_q = {token_bucket(q) for _, lens in shapes for q in lens}
    for q in range(2, min(budget, max_len) + 1):
        assert token_bucket(q) in warmed_q, q
    # decodes beside a prompt (the decode kernel's batch buckets)
    warmed_d = {batch_bucket(d) for d, _ in shapes if d}
    for d in range(1, min(seqs, budget - SHORT_PREFILL + 1)):
        assert batch_bucket(d) in warmed_d, d
    meta, positions = _meta(3, [5, 2], 16, 7, torch.device("cpu"))
    assert meta.query_start_loc == [0, 1, 2, 3, 8, 10] and meta.seq_lens == [16] * 3 + [5, 2]
    assert positions.tolist() == [15, 15, 15, 0, 1, 2, 3, 4, 0, 1]
    assert meta.block_tables.shape == (5, 1) and int(meta.block_tables.max()) == 7
    assert set(meta.slot_mapping.tolist()) == {7 * 16}
