"""A teacher cache built beside the training steps (teacher_stream.py): the rows in the steps'
order, lookups that wait for unwritten rows, the same values as a build before the steps, and
errors or a stop that leave nothing behind."""
import os
import threading
import time
import types

import numpy as np
import pytest

from jax_tinybert.teacher import cache as tc

from jax_tinybert.teacher import training as tt
import dataclasses

from jax_tinybert.speed import profiles
from jax_tinybert.teacher import stream as ts
from jax_tinybert.data.batching import BucketedBatcher, assign_buckets

import test_teacher_cache

small = test_teacher_cache.small   # the tiny teacher and data set (a module-scoped fixture)
_intermediate = test_teacher_cache._intermediate

BUCKETS = (16, 32, 64)


def _train(ds, seed=2, bs=8):
    return BucketedBatcher(ds, bs, BUCKETS, train=True, seed=seed, process_index=0,
                           process_count=1)


def _plan_steps(batcher, epoch, start, stop):
    plan = batcher.epoch_plan(epoch)
    return [(int(plan.seq_lens[s]), plan.rows[s]) for s in range(start, stop)]


def test_steps_order_runs_from_the_position_to_the_end_of_its_epoch(small):
    b = _train(small.ds)
    spe = b.steps_per_epoch
    assert spe >= 3
    order = ts.steps_order(b, 10 * spe)
    next(b)   # the steps move on while the build thread iterates the order: read at the call
    got = list(order)
    want = _plan_steps(b, 0, 0, spe)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(np.array_equal(g, w) for (_, g), (_, w) in zip(got, want))
    # A resumed run: from its step, only to the end of that epoch; a run that ends earlier.
    b.load_state_dict({"epoch": 1, "step": 1})
    assert [r.tolist() for _, r in ts.steps_order(b, 10 * spe)] == \
        [r.tolist() for _, r in _plan_steps(b, 1, 1, spe)]
    assert [r.tolist() for _, r in ts.steps_order(b, spe + 2)] == \
        [r.tolist() for _, r in _plan_steps(b, 1, 1, 2)]
    b.load_state_dict({"epoch": 0, "step": spe})   # at the end of an epoch: the next one
    assert [r.tolist() for _, r in ts.steps_order(b, 10 * spe)] == \
        [r.tolist() for _, r in _plan_steps(b, 1, 0, spe)]
    assert list(ts.steps_order(b, spe)) == []


def test_ordered_batches_follow_the_steps_then_cover_the_rest_once(small):
    ds, b = small.ds, _train(small.ds)
    order = _plan_steps(b, 0, 0, b.steps_per_epoch)
    chunks = list(tt._ordered_row_batches(ds, order, None, BUCKETS, 64))
    lengths = np.asarray(ds.lengths)
    seen = []
    for c in chunks:
        R, T = c["input_ids"].shape
        assert R == tt.rows_per_forward(T, 8)   # the shapes of a build before steps of 8 rows
        real = c["example_id"] >= 0
        assert np.array_equal(real, c["valid"] > 0) and real.any()
        ids = c["example_id"][real]
        # Each row at its own bucket's length, with its own tokens.
        assert np.all(np.asarray(BUCKETS)[assign_buckets(lengths[ids], BUCKETS)] == T)
        for r, i in zip(np.flatnonzero(real), ids):
            n = lengths[i]
            assert c["attention_mask"][r].sum() == n
            np.testing.assert_array_equal(c["input_ids"][r, :n], ds.gather([i], T)["input_ids"][0, :n])
        seen.extend(ids.tolist())
    # Every row once: the steps' rows first, in their order, then those no step of the epoch reads.
    assert sorted(seen) == list(range(len(ds)))
    in_steps = [int(i) for _, r in order for i in r if i >= 0]
    assert seen[:len(in_steps)] == in_steps
    # Only the rows asked for.
    rows = np.asarray(sorted(set(in_steps[:8]) | {in_steps[-1]}), np.int64)
    sub = [i for c in tt._ordered_row_batches(ds, order, rows, BUCKETS, 64)
           for i in c["example_id"][c["example_id"] >= 0].tolist()]
    assert sorted(sub) == rows.tolist() and sub[:8] == in_steps[:8]


def _build(tmp_path, small, name, beside):
    obj, models, _, _ = _intermediate(small)
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=_train(small.ds))
    spe = data.train_batches.steps_per_epoch
    kw = dict(num_steps=2 * spe, token_dtype="float32")
    if not beside:
        return tt.build_for_training(models, obj, data, str(tmp_path / name), **kw), data
    order = ts.steps_order(data.train_batches, 2 * spe)
    return ts.StreamingCache(lambda live: tt.build_for_training(
        models, obj, data, str(tmp_path / name), live=live, order=order, **kw), "float32"), data


def test_built_beside_the_steps_holds_what_a_build_before_them_holds(tmp_path, small):
    before, data = _build(tmp_path, small, "before", beside=False)
    stream, _ = _build(tmp_path, small, "beside", beside=True)
    it, spe = _train(small.ds), data.train_batches.steps_per_epoch
    for _ in range(2 * spe):
        batch = next(it)
        T = batch["input_ids"].shape[1]
        got, want = stream.lookup(batch["example_id"], seq_len=T), before.lookup(
            batch["example_id"], seq_len=T)
        assert set(got) == set(want) == {"teacher_attn", "teacher_hidden"}
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
    cache = stream.result()
    assert cache.fingerprint == before.fingerprint
    assert cache.build_stats["rows"] == before.build_stats["rows"] == len(small.ds)
    # The same cache on disk, the rows in the order of the first epoch's steps.
    first = [int(i) for _, r in _plan_steps(data.train_batches, 0, 0, spe) for i in r]
    offsets = cache.token_index[first, 1]
    assert np.all(np.diff(offsets) > 0)
    reopened = tc.open_cache(cache.path, cache.fingerprint)   # checksums verified
    for name in ("teacher_attn", "teacher_hidden"):
        assert reopened.meta["token_fields"][name]["bytes"] == \
            before.meta["token_fields"][name]["bytes"]
    assert not [p for p in os.listdir(tmp_path / "beside" / "cache") if p != "teacher"]


class _Gate:
    """A forward that lets `free` chunks through, then waits for `go` (or raises `error` there)."""

    def __init__(self, forward, free, error=None):
        self.forward, self.free, self.error = forward, free, error
        self.go, self.calls = threading.Event(), 0
        self.lower = getattr(forward, "lower", None)

    def __call__(self, *args):
        self.calls += 1
        if self.calls > self.free:
            if self.error is not None:
                raise self.error
            assert self.go.wait(30)
        return self.forward(*args)


@pytest.fixture
def gated(monkeypatch):
    """Wraps the per-token build's forward in a `_Gate` (kw: its arguments), one forward in
    flight."""
    out = types.SimpleNamespace(kw={"free": 1}, gates=[])
    real = tt._training_forward

    def wrapped(*a, **k):
        out.gates.append(_Gate(real(*a, **k), **out.kw))
        return out.gates[-1]

    monkeypatch.setattr(tt, "_training_forward", wrapped)
    monkeypatch.setattr(profiles, "CPU", dataclasses.replace(profiles.CPU, forwards_in_flight=1))
    return out


def test_a_lookup_waits_for_its_rows(tmp_path, small, gated):
    stream, data = _build(tmp_path, small, "c", beside=True)
    b = _train(small.ds)
    first = next(b)
    T = first["input_ids"].shape[1]
    # The first step's rows: one chunk (8 rows at 16 or 32 tokens).
    assert tt.rows_per_forward(T, 8) == 8
    got = stream.lookup(first["example_id"], seq_len=T)
    assert got["teacher_attn"].shape[:1] == (8,)
    late = next(b)
    out = {}
    t = threading.Thread(target=lambda: out.update(stream.lookup(
        late["example_id"], seq_len=late["input_ids"].shape[1])))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not out       # its rows are not written yet
    gated.gates[0].go.set()
    t.join(30)
    assert not t.is_alive() and set(out) == {"teacher_attn", "teacher_hidden"}
    cache = stream.result()
    np.testing.assert_array_equal(out["teacher_attn"], cache.lookup(
        late["example_id"], seq_len=late["input_ids"].shape[1])["teacher_attn"])


def test_a_failed_build_raises_in_the_lookup_and_leaves_nothing(tmp_path, small, gated):
    gated.kw = {"free": 1, "error": OSError(28, "No space left on device")}
    stream, _ = _build(tmp_path, small, "e", beside=True)
    b = _train(small.ds)
    next(b)
    late = next(b)
    with pytest.raises(OSError, match="No space left"):
        stream.lookup(late["example_id"], seq_len=late["input_ids"].shape[1])
    with pytest.raises(OSError, match="No space left"):
        stream.result()
    assert os.listdir(tmp_path / "e" / "cache") == []   # no folder, no temporary one


def test_stop_ends_the_build_and_removes_its_folder(tmp_path, small, gated):
    stream, _ = _build(tmp_path, small, "s", beside=True)
    deadline = time.time() + 30
    while not gated.gates and time.time() < deadline:
        time.sleep(0.01)
    threading.Timer(0.3, gated.gates[0].go.set).start()
    stream.stop()
    assert not stream._thread.is_alive()
    assert gated.gates[0].calls < 20   # stopped after the chunk in flight, not at the end
    assert os.listdir(tmp_path / "s" / "cache") == []
    with pytest.raises(ts.BuildStopped):
        stream.result()


def _pred(small):
    """(objective, models) of a prediction stage over the tiny teacher: a cache of its logits."""
    from jax_tinybert.distill import objectives

    t_cfg = small.model.config
    obj = objectives.make_objective("tinybert_pred", {"mode": "tinybert"},
                                    t_cfg.replace(num_hidden_layers=1), t_cfg)
    models = types.SimpleNamespace(teacher=small.model, teacher_params=small.params,
                                   teacher_config=t_cfg,
                                   tokenizer_dir=test_teacher_cache._TOKENIZER_DIR())
    return obj, models


def test_a_logits_cache_built_beside_the_steps_follows_them_and_holds_what_one_before_holds(
        tmp_path, small, monkeypatch):
    """The prediction stage's cache (teacher logits, one row per example) built beside the
    steps: its rows are written in the steps' order, each lookup gets what a build before the
    steps holds, and the finished cache is that build's. `follows_steps` says which passes can
    be built so: not a packed one (several examples a row, in no step's order)."""
    obj, models = _pred(small)
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=_train(small.ds))
    spe = data.train_batches.steps_per_epoch
    monkeypatch.setattr(tt, "PACK_GAIN", 1e9)   # packing always pays: not in the steps' order
    assert not tt.follows_steps(obj, data, None, 2 * spe)
    assert tt.follows_steps(_intermediate(small)[0], data, "float32", 2 * spe)   # per-token
    monkeypatch.setattr(tt, "PACK_GAIN", 0.0)   # it never does (MRPC's pairs)
    assert tt.follows_steps(obj, data, None, 2 * spe)

    before = tt.build_for_training(models, obj, data, str(tmp_path / "before"),
                                   num_steps=2 * spe)
    written, fill = [], ts.Live.fill

    def record(self, filled, ids):
        written.extend(np.asarray(ids).tolist())
        fill(self, filled, ids)

    monkeypatch.setattr(ts.Live, "fill", record)
    order = ts.steps_order(data.train_batches, 2 * spe)
    stream = ts.StreamingCache(lambda live: tt.build_for_training(
        models, obj, data, str(tmp_path / "beside"), num_steps=2 * spe, live=live,
        order=order), None)
    it = _train(small.ds)
    for _ in range(spe):
        ids = next(it)["example_id"]
        got, want = stream.lookup(ids), before.lookup(ids)
        assert set(got) == set(want) and "teacher_logits" in got
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
    cache = stream.result()
    assert cache.fingerprint == before.fingerprint
    # The steps' rows first, in their order, then the rows no step of the epoch reads.
    first = [int(i) for _, r in _plan_steps(data.train_batches, 0, 0, spe) for i in r if i >= 0]
    assert written[:len(first)] == first and sorted(written) == list(range(len(small.ds)))
    # (Forwarded in the steps' chunks, not the build's batches of 64: other products.)
    np.testing.assert_allclose(cache.lookup(np.arange(len(small.ds)))["teacher_logits"],
                               before.lookup(np.arange(len(small.ds)))["teacher_logits"],
                               rtol=1e-6, atol=1e-6)
    assert not [p for p in os.listdir(tmp_path / "beside" / "cache") if p != "teacher"]


@pytest.mark.parametrize("kind", ["logits", "tokens"])
def test_a_first_lookup_after_the_pass_before_the_builds_end_reads_every_field(
        tmp_path, small, monkeypatch, kind):
    """Every row written and the folder published under its final name, the build not yet
    returned: a first lookup there gets every field of the rows. It once got none of a logits
    cache's fields (the build had dropped its maps: the step failed for want of the teacher's
    logits), and a per-token cache's files were looked for under the temporary name."""
    if kind == "logits":
        (obj, models), dtype, fields = _pred(small), None, {"teacher_logits"}
        monkeypatch.setattr(tt, "PACK_GAIN", 0.0)
    else:
        obj, models, _, _ = _intermediate(small)
        dtype, fields = "float32", {"teacher_attn", "teacher_hidden"}
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=_train(small.ds))
    spe = data.train_batches.steps_per_epoch
    kw = dict(num_steps=2 * spe, token_dtype=dtype)
    before = tt.build_for_training(models, obj, data, str(tmp_path / "before"), **kw)
    published, go = threading.Event(), threading.Event()
    publish = tc.fs.publish_dir

    def held(*a, **k):   # the pass is over and its folder renamed; the build returns later
        out = publish(*a, **k)
        published.set()
        assert go.wait(30)
        return out

    monkeypatch.setattr(tc.fs, "publish_dir", held)
    order = ts.steps_order(data.train_batches, 2 * spe)
    stream = ts.StreamingCache(lambda live: tt.build_for_training(
        models, obj, data, str(tmp_path / "beside"), live=live, order=order, **kw), dtype)
    it = _train(small.ds)
    try:
        assert published.wait(30)
        assert not os.path.exists(stream.live.parts["folder"])   # renamed
        for _ in range(spe):
            b = next(it)
            T = b["input_ids"].shape[1]
            got = stream.lookup(b["example_id"], seq_len=T)
            want = before.lookup(b["example_id"], seq_len=T)
            assert set(got) == set(want) == fields
            for k in want:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
    finally:
        go.set()
    stream.result()
    assert stream.live.parts is None   # the build's maps are let go with it
