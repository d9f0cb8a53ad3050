"""speed.resolve: every auto speed knob made concrete per backend and run, recorded in the run's
config.json, and ignored by the workdir check (a workdir made on one backend resumes on another)."""
import json

import pytest

from jax_tinybert import speed
from jax_tinybert.config import schema
from jax_tinybert.config.check import ConfigValueError, check_workdir
from jax_tinybert.train import build


def _facts(total=5000, spe=100, buckets=2, **kw):
    return speed.RunFacts(total_steps=total, steps_per_epoch=spe, num_buckets=buckets, **kw)


def test_the_backend_alone_decides_three_knobs():
    c = schema.base_config()
    cpu, notes = speed.resolve(c, "cpu")
    gpu, _ = speed.resolve(c, "gpu")
    assert notes == {}
    assert (cpu.data.bucket_compile_steps, cpu.train.checkpoint_seconds) == (8.0, 0.0)
    assert (gpu.data.bucket_compile_steps, gpu.train.checkpoint_seconds) == (2000.0, 30.0)
    assert cpu.train.compile_workers == 1
    # Run-dependent knobs wait for the run's facts; the input config is not changed.
    assert cpu.train.split_update == "auto" and cpu.train.chunk_tokens == -1
    assert c.data.bucket_compile_steps == -1.0 and c.train.compile_workers == 0


@pytest.mark.parametrize("backend,facts,want", [
    ("cpu", dict(total=1001, buckets=2), ("never", 1024, "before")),   # over 500 a bucket
    ("cpu", dict(total=5000, buckets=2, objective="tinybert_intermediate"),
     ("always", 1024, "before")),
    ("cpu", dict(total=150, buckets=2), ("always", 0, "before")),      # 75 steps a bucket
    ("cpu", dict(total=1000, buckets=1, devices=8), ("never", 0, "before")),
    ("cpu", dict(total=1000, buckets=1, logits_cache=True, follows_steps=lambda td: True),
     ("never", 1024, "beside")),
    ("cpu", dict(total=1000, buckets=1, logits_cache=True, follows_steps=lambda td: False),
     ("never", 1024, "before")),   # a packed pass: the first step would wait for all of it
    ("gpu", dict(total=10, buckets=1, objective="tinybert_intermediate", logits_cache=True,
                 follows_steps=lambda td: True), ("never", 0, "before")),
])
def test_the_run_decides_the_others(backend, facts, want):
    c, _ = speed.resolve(schema.base_config(), backend, _facts(**facts))
    assert (c.train.split_update, c.train.chunk_tokens, c.teacher.cache_build) == want


def test_the_per_token_cache_is_kept_for_long_cpu_runs_that_fit():
    c = schema.base_config()
    fits = dict(token_cacheable=True, token_cache_fits=lambda: (True, "1.00 GB"))
    got, notes = speed.resolve(c, "cpu", _facts(total=300, spe=100, **fits))
    assert got.teacher.cache_tokens == "always" and notes["teacher.cache_tokens"] == "1.00 GB"
    got, notes = speed.resolve(c, "cpu", _facts(total=200, spe=100, **fits))
    assert got.teacher.cache_tokens == "never" and "at most 2 epochs" in notes[
        "teacher.cache_tokens"]
    got, notes = speed.resolve(c, "gpu", _facts(total=300, spe=100, **fits))
    assert got.teacher.cache_tokens == "never" and notes["teacher.cache_tokens"].startswith(
        "on gpu the teacher's forward in the step is faster")
    full = dict(token_cacheable=True, token_cache_fits=lambda: (False, "need 9 GB"))
    got, notes = speed.resolve(c, "cpu", _facts(total=300, spe=100, **full))
    assert got.teacher.cache_tokens == "never"
    assert notes["teacher.cache_tokens"] == "need 9 GB: the teacher runs in every step"


def test_values_set_by_the_user_are_kept_and_resolving_twice_changes_nothing():
    c = schema.base_config()
    c.train.split_update, c.train.chunk_tokens, c.train.compile_workers = "never", 256, 3
    c.teacher.cache_build = "before"
    once, _ = speed.resolve(c, "cpu", _facts(objective="tinybert_intermediate"))
    assert (once.train.split_update, once.train.chunk_tokens, once.train.compile_workers,
            once.teacher.cache_build) == ("never", 256, 3, "before")
    twice, _ = speed.resolve(once, "gpu", _facts())
    assert speed.concrete(twice) == speed.concrete(once)
    assert set(speed.concrete(once)) == set(speed.SPEED_FIELDS)


def test_a_workdir_resumes_whatever_its_speed_knobs_became(tmp_path):
    """The workdir check compares what decides the trained model: a run whose knobs resolved
    one way on a GPU resumes on a CPU that resolves them another, and a record written before
    the knobs were left out of the fingerprint (they were in its "resolved" fields) resumes
    too; a change that does decide the model is still refused."""
    c = build.with_defaults(schema.base_config())
    c.data.kind = "synthetic"
    w = tmp_path / "w"
    on_gpu, _ = speed.resolve(c, "gpu", _facts(total=10))
    check_workdir(on_gpu, str(w))
    (w / "checkpoints" / "4").mkdir(parents=True)
    on_cpu, _ = speed.resolve(c, "cpu", _facts(total=10000, objective="tinybert_intermediate"))
    assert speed.concrete(on_cpu) != speed.concrete(on_gpu)
    check_workdir(on_cpu, str(w))

    record = json.loads((w / "config.json").read_text())
    record["fingerprint"] = "an-older-one"
    record["resolved"].update({"train.split_update": "auto", "train.compile_ahead": True,
                               "teacher.cache_tokens": "auto", "teacher.cache_build": "auto",
                               "data.bucket_compile_steps": -1.0})
    (w / "config.json").write_text(json.dumps(record))
    check_workdir(on_cpu, str(w))

    on_cpu.train.batch_size = 16
    with pytest.raises(ConfigValueError, match=r"train.batch_size: 32 -> 16"):
        check_workdir(on_cpu, str(w))


def test_the_run_records_what_auto_became(tmp_path):
    from jax_tinybert.config.check import record_speed

    c, _ = speed.resolve(build.with_defaults(schema.base_config()), "cpu", _facts())
    w = tmp_path / "w"
    check_workdir(c, str(w))
    record_speed(str(w), speed.concrete(c))
    got = json.loads((w / "config.json").read_text())["speed"]
    assert got["train.split_update"] == "never" and got["data.bucket_compile_steps"] == 8.0
    assert got["train.chunk_tokens"] == 1024
