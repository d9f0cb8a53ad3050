"""Teacher store: teacher outputs computed by one run are reused by the next run with the same
teacher and data, equal to a live forward; other teachers, missing rows and damage rebuild."""
import logging
import os
import types

import jax
import numpy as np
import pytest

from jax_tinybert.distill import objectives
from jax_tinybert.teacher import cache as tc
from jax_tinybert.teacher import training as tt
from jax_tinybert.teacher import store as ts
from jax_tinybert.data.batching import BucketedBatcher
from test_teacher_cache import _TOKENIZER_DIR, _intermediate, small  # noqa: F401 (fixture)


def _pred_run(small, params=None):
    t_cfg = small.model.config
    obj = objectives.make_objective("tinybert_pred", {"mode": "masked"},
                                    t_cfg.replace(num_hidden_layers=1), t_cfg)
    models = types.SimpleNamespace(teacher=small.model, teacher_params=params or small.params,
                                   teacher_config=t_cfg, tokenizer_dir=_TOKENIZER_DIR())
    return obj, models


def _data(small, buckets=(16, 32, 64)):
    return types.SimpleNamespace(train_dataset=small.ds, train_batches=BucketedBatcher(
        small.ds, 8, buckets, train=True, seed=2, process_index=0, process_count=1))


def _live_logits(small, params, ids):
    """The teacher's logits of dataset rows `ids`, each forwarded at its own length, no padding
    and no mask (the rows of one length go in one batch: rows do not interact). Jitted: run op
    by op, the model took ~1.3 s an example."""
    fwd = jax.jit(lambda p, x: small.model.apply({"params": p}, x, np.ones(x.shape, np.int32),
                                                 np.zeros(x.shape, np.int32)).logits)
    ids = np.asarray(ids)
    lens = small.ds.offsets[ids + 1] - small.ds.offsets[ids]
    out = np.zeros((len(ids), small.model.config.num_labels), np.float32)
    for n in np.unique(lens):
        at = np.flatnonzero(lens == n)
        x = np.stack([small.ds.input_ids[small.ds.offsets[i]:small.ds.offsets[i] + n]
                      for i in ids[at]])
        out[at] = np.asarray(fwd(params, x))
    return out


def _no_forward(monkeypatch):
    def build(*a, **k):
        raise AssertionError("the teacher ran: the store should have served these outputs")
    monkeypatch.setattr(tc, "build", build)


def test_second_run_reads_the_store_instead_of_the_teacher(tmp_path, small, monkeypatch):
    store = ts.Store(str(tmp_path / "store"))
    obj, models = _pred_run(small)
    first = tt.build_for_training(models, obj, _data(small), str(tmp_path / "a"), store=store)
    assert first.build_stats is not None
    assert len(os.listdir(store.root)) == 1
    # Another workdir, the same teacher and data: no teacher forward at all.
    _no_forward(monkeypatch)
    second = tt.build_for_training(models, obj, _data(small), str(tmp_path / "b"), store=store)
    assert second.build_stats is None
    ids = np.arange(len(small.ds))
    want = _live_logits(small, small.params, ids)
    got = second.lookup(ids)["teacher_logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got, first.lookup(ids)["teacher_logits"])
    # The workdir copy carries the run's own fingerprint: a rerun there is up to date, store off.
    again = tt.build_for_training(models, obj, _data(small), str(tmp_path / "b"))
    assert again.build_stats is None
    assert sorted(os.listdir(tmp_path / "b" / "cache")) == ["teacher"]   # no temporaries left


def test_other_teacher_params_other_entry(tmp_path, small):
    store = ts.Store(str(tmp_path / "store"))
    obj, models = _pred_run(small)
    tt.build_for_training(models, obj, _data(small), str(tmp_path / "a"), store=store)
    params = jax.tree_util.tree_map(np.copy, small.params)
    params["classifier"]["bias"] = params["classifier"]["bias"] + 0.5
    obj, other = _pred_run(small, params)
    c = tt.build_for_training(other, obj, _data(small), str(tmp_path / "b"), store=store)
    assert c.build_stats is not None
    assert len(os.listdir(store.root)) == 2
    np.testing.assert_allclose(c.lookup([0])["teacher_logits"],
                               _live_logits(small, params, [0]), rtol=1e-5, atol=1e-5)


def test_intermediate_build_publishes_the_logits_the_pred_stage_reads(tmp_path, small,
                                                                     monkeypatch):
    store = ts.Store(str(tmp_path / "store"))
    obj, models, _, _ = _intermediate(small)
    spe = _data(small).train_batches.steps_per_epoch
    inter = tt.build_for_training(models, obj, _data(small), str(tmp_path / "inter"),
                                  num_steps=3 * spe, token_dtype="float16", store=store)
    assert inter.build_stats is not None
    # The intermediate batches get the per-token fields only.
    assert set(inter.lookup([0], seq_len=int(inter.token_index[0, 0]))) == \
        {"teacher_attn", "teacher_hidden"}
    (entry,) = os.listdir(store.root)
    assert sorted(f for f in os.listdir(os.path.join(store.root, entry)) if f.endswith(".npy")) \
        == ["filled.npy", "teacher_logits.npy"]
    pobj, pmodels = _pred_run(small)
    _no_forward(monkeypatch)
    pred = tt.build_for_training(pmodels, pobj, _data(small), str(tmp_path / "pred"),
                                 num_steps=spe, store=store)
    assert pred.build_stats is None
    ids = np.flatnonzero(pred.filled)
    np.testing.assert_allclose(pred.lookup(ids)["teacher_logits"],
                               _live_logits(small, small.params, ids), rtol=1e-5, atol=1e-5)


def test_a_run_of_an_epoch_publishes_every_row(tmp_path, small, monkeypatch):
    """An epoch leaves each bucket's incomplete batch unread, other rows for other buckets: the
    run publishes those rows too, so a run with other buckets finds all it reads, no forward."""
    store = ts.Store(str(tmp_path / "store"))
    obj, models = _pred_run(small)
    a = _data(small, buckets=(16, 32, 64))
    read = a.train_batches.rows_read(a.train_batches.steps_per_epoch)
    assert len(read) < len(small.ds)     # the premise: one epoch leaves rows unread
    first = tt.build_for_training(models, obj, a, str(tmp_path / "a"),
                                  num_steps=a.train_batches.steps_per_epoch, store=store)
    assert np.asarray(first.filled).all()
    b = _data(small, buckets=(24, 64))
    need = b.train_batches.rows_read(b.train_batches.steps_per_epoch)
    _no_forward(monkeypatch)
    second = tt.build_for_training(models, obj, b, str(tmp_path / "b"),
                                   num_steps=b.train_batches.steps_per_epoch, store=store)
    assert second.build_stats is None and np.asarray(second.filled)[need].all()
    np.testing.assert_allclose(second.lookup(need)["teacher_logits"],
                               _live_logits(small, small.params, need), rtol=1e-5, atol=1e-5)


def test_an_entry_of_other_buckets_is_completed_not_rebuilt(tmp_path, small, monkeypatch):
    """A run with other buckets reads a few rows the entry lacks (both runs read less than an
    epoch, so neither forwards the rows it does not read): only those are forwarded; the rest
    come from the store."""
    store = ts.Store(str(tmp_path / "store"))
    obj, models = _pred_run(small)
    a = _data(small, buckets=(16, 32, 64))
    first = tt.build_for_training(models, obj, a, str(tmp_path / "a"),
                                  num_steps=a.train_batches.steps_per_epoch - 1, store=store)
    b = _data(small, buckets=(24, 64))
    steps_b = b.train_batches.steps_per_epoch - 1
    need = b.train_batches.rows_read(steps_b)
    lacking = need[~np.asarray(first.filled)[need]]
    assert 0 < len(lacking) <= len(need) // 4, (len(lacking), len(need))
    _no_forward(monkeypatch)    # no full build: tc.build would fail
    second = tt.build_for_training(models, obj, b, str(tmp_path / "b"), num_steps=steps_b,
                                   store=store)
    assert second.build_stats is None and np.asarray(second.filled)[need].all()
    np.testing.assert_allclose(second.lookup(need)["teacher_logits"],
                               _live_logits(small, small.params, need), rtol=1e-5, atol=1e-5)
    # The copy is intact (checksums of the completed files) and the entry grew to both runs' rows.
    tc.open_cache(str(tmp_path / "b" / "cache" / "teacher"), verify=True)
    (entry,) = os.listdir(store.root)
    grown = np.load(os.path.join(store.root, entry, "filled.npy"))
    assert grown[need].all() and grown[np.flatnonzero(first.filled)].all()


def test_missing_rows_or_damage_rebuild(tmp_path, small, caplog):
    store = ts.Store(str(tmp_path / "store"))
    obj, models = _pred_run(small)
    # A 1-step run reads 8 of the 37 rows: its entry cannot serve a run that reads them all.
    part = tt.build_for_training(models, obj, _data(small), str(tmp_path / "a"), num_steps=1,
                                 store=store)
    assert int(part.filled.sum()) == 8
    full = tt.build_for_training(models, obj, _data(small), str(tmp_path / "b"), store=store)
    assert full.build_stats is not None
    (entry,) = os.listdir(store.root)    # the entry now has every row (replaced)
    assert int(np.load(os.path.join(store.root, entry, "filled.npy")).sum()) == len(small.ds)
    # A flipped byte in the entry: ignored with a warning, removed, rebuilt and stored again.
    p = os.path.join(store.root, entry, "teacher_logits.npy")
    raw = bytearray(open(p, "rb").read())
    raw[-3] ^= 0xFF
    open(p, "wb").write(bytes(raw))
    with caplog.at_level(logging.WARNING):
        c = tt.build_for_training(models, obj, _data(small), str(tmp_path / "c"), store=store)
    assert c.build_stats is not None and "damaged entry" in caplog.text
    np.testing.assert_allclose(c.lookup([5])["teacher_logits"],
                               _live_logits(small, small.params, [5]), rtol=1e-5, atol=1e-5)
    assert store.find(dict(tc.open_cache(str(tmp_path / "c" / "cache" / "teacher")).fingerprint),
                      None) is not None


@pytest.mark.parametrize("value,want", [("off", None), ("0", None), ("~/x", "HOME/x"),
                                        (None, "HOME/.cache/jax_tinybert/teacher")])
def test_store_location_from_env(monkeypatch, tmp_path, value, want):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if value is None:
        monkeypatch.delenv(ts.ENV, raising=False)
    else:
        monkeypatch.setenv(ts.ENV, value)
    got = ts.from_env()
    assert (got.root if got else None) == (want and want.replace("HOME", str(tmp_path)))


def test_no_home_no_store(monkeypatch):
    monkeypatch.delenv(ts.ENV, raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(os.path, "expanduser", lambda p: p)   # what it does with no home at all
    assert ts.from_env() is None
