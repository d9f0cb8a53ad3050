"""FLOP counts by XLA's cost analysis, against the hand-computed 2 M N K of a matmul."""
import concurrent.futures as cf
import io
import math
import re

import jax
import numpy as np

from jax_tinybert.speed import precompile
from jax_tinybert import progress, flops as work
from jax_tinybert.teacher import cache as teacher_cache


def test_program_flops_of_a_matmul_is_two_m_n_k():
    f = jax.jit(lambda a, b: a @ b)
    a, b = np.ones((48, 20), np.float32), np.ones((20, 36), np.float32)
    assert work.program_flops(f.lower(a, b)) == 2 * 48 * 20 * 36
    assert math.isnan(work.program_flops(None))


def test_program_flops_falls_back_to_cpu_analysis():
    """The GPU plugin has no Lowered.cost_analysis: the same HLO is costed on the CPU backend."""
    low = jax.jit(lambda a, b: a @ b).lower(np.ones((64, 32), np.float32),
                                            np.ones((32, 16), np.float32))

    class NoCost:
        def cost_analysis(self):
            raise NotImplementedError

        def compiler_ir(self, dialect):
            return low.compiler_ir(dialect)

    assert work.program_flops(low) == work.program_flops(NoCost()) == 2 * 64 * 32 * 16


def test_work_counts_each_call_and_analyses_each_program_once():
    f = jax.jit(lambda a: a @ a.T)
    lowered = []
    w = work.Work()

    def call(n):
        a = np.ones((n, 8), np.float32)
        f(a)
        w.add((n,), lambda: lowered.append(n) or f.lower(a))

    with cf.ThreadPoolExecutor(2) as pool:
        list(pool.map(call, [4, 4, 6, 4, 6]))
    assert w.calls == 5 and w.known
    assert w.flops == 3 * 2 * 4 * 8 * 4 + 2 * 2 * 6 * 8 * 6
    assert sorted(set(lowered)) == [4, 6]
    w.add(("plain",), lambda: None)   # a program with no count: the total is not "known"
    assert w.calls == 6 and not w.known


def test_fmt():
    assert work.fmt(5.214e12, 38.0) == "5.21 TFLOP, 137 GFLOP/s"
    assert work.fmt(34.87e9) == "34.87 GFLOP"


def test_progress_closing_line_takes_a_note(monkeypatch):
    t = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: t[0])
    out = io.StringIO()
    p = progress.Progress("teacher cache", total=100, unit="ex", stream=out, every_s=1e9,
                          enabled=True, bar=False)
    t[0] = 4.0
    p.update(100)
    p.close(note="1.00 TFLOP, 250 GFLOP/s")
    assert out.getvalue().splitlines()[-1] == \
        "[teacher cache] 100 ex in 4s (25 ex/s; 1.00 TFLOP, 250 GFLOP/s)"


def test_teacher_pass_counts_the_flops_of_its_forwards(tmp_path, monkeypatch):
    """A forward of one [b, T] x [T, 3] product per batch: the pass's FLOPs are the sum of
    2 b T 3 over its batches, whatever the threads that ran them (two at once on CPU), counted
    on one CPU device from the compiled forwards (no lowered module converted to HLO again)."""
    converted = []
    real = jax.stages.Lowered.cost_analysis
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis",
                        lambda self: converted.append(self) or real(self))

    @jax.jit
    def forward(w, ids, mask, types):
        # float ids: XLA counts a convert (or any elementwise op) as a FLOP per element.
        return {"teacher_logits": ids @ w[: ids.shape[1]]}

    w = np.ones((64, 3), np.float32)
    rng = np.random.default_rng(0)
    shapes = [(8, 16), (8, 16), (8, 32), (4, 32), (8, 16)]
    batches, n = [], 0
    for b, T in shapes:
        ids = rng.integers(1, 50, size=(b, T)).astype(np.float32)
        batches.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                        "token_type_ids": np.zeros_like(ids),
                        "example_id": np.arange(n, n + b), "valid": np.ones(b, np.int32)})
        n += b
    cache = teacher_cache.build(str(tmp_path / "cache"), {"t": 1}, forward, w, batches, n)
    np.testing.assert_array_equal(
        cache.lookup(np.arange(8))["teacher_logits"],
        np.repeat(batches[0]["input_ids"].sum(1, keepdims=True), 3, 1))
    assert cache.build_stats["flops"] == sum(2 * b * T * 3 for b, T in shapes)
    assert converted == []
    # A forward that is not jitted has no count: none is reported, nothing fails.
    plain = teacher_cache.build(str(tmp_path / "plain"), {"t": 2}, forward.__wrapped__, w,
                                batches, n)
    assert "flops" not in plain.build_stats


def test_programs_compiled_ahead_report_the_flops_of_their_calls():
    """Two programs (two batch shapes) of a jitted matmul, called 3 + 2 times."""
    f = jax.jit(lambda w, x: x @ w)
    w = np.ones((8, 5), np.float32)
    compiler = precompile.Compiler()
    step = compiler.wrap(f, "toy step")
    for n in (4, 6):
        step.submit(w, jax.ShapeDtypeStruct((n, 8), np.float32))
    for n in (4, 6, 4, 4, 6):
        step(w, np.ones((n, 8), np.float32))
    line = compiler.close()
    total = 3 * 2 * 4 * 8 * 5 + 2 * 2 * 6 * 8 * 5
    assert step.work.flops == total and step.work.calls == 5
    assert re.fullmatch(r"toy step 2 of 2 programs \(5 of 5 calls; [\d.]+ [\d.]+ s; "
                        + re.escape(work.fmt(total)) + r"\)", line), line


def test_a_program_on_one_cpu_device_is_counted_compiled_and_as_its_lowered_form():
    """`counted_program`: the compiled program (its analysis needs no HLO conversion) where it
    runs on one CPU device, with the lowered form's count of a matmul; a partitioned program
    (its analysis is one device's share) and one with no shardings to read count lowered."""
    import types

    f = jax.jit(lambda a, b: a @ b)
    a, b = np.ones((48, 20), np.float32), np.ones((20, 36), np.float32)
    low = f.lower(a, b)
    compiled = low.compile()
    assert work.counted_program(low, compiled) is compiled
    assert work.program_flops(compiled) == 2 * 48 * 20 * 36

    class Device:   # a second CPU device, as --xla_force_host_platform_device_count=2 has
        platform = "cpu"

    two = types.SimpleNamespace(
        input_shardings=[types.SimpleNamespace(device_set={jax.devices("cpu")[0], Device()})],
        output_shardings=[])
    assert work.counted_program(low, two) is low
    assert work.counted_program(low, object()) is low
    assert work.counted_program(low, None) is low
