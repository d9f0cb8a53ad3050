"""teacher/positions.py: the per-position logits of every train row computed once in buckets,
looked up by example_id at a batch's length, equal to the teacher's forward on that batch."""
import numpy as np
import pytest

from jax_tinybert.data.tokenize import EncodedDataset
from jax_tinybert.model import heads
from jax_tinybert.model.modeling import BertConfig, random_params
from jax_tinybert.teacher import positions


def _dataset(lengths, seed=0):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(5, 100, size=int(offsets[-1])).astype(np.int32)
    types = (rng.random(int(offsets[-1])) < 0.3).astype(np.int8)
    return EncodedDataset(ids, types, offsets, None, 0)


@pytest.mark.parametrize("head", ["span", "token"])
def test_lookup_equals_the_forward_of_the_batch(head):
    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32,
                     num_labels=2 if head == "span" else 5)
    model = heads.MODELS[head](cfg)
    params = random_params(model, 0)
    ds = _dataset([3, 9, 16, 5, 12, 7, 2])
    cache = positions.build(model, params, ds, (8, 16), head, batch_size=4, cls_layers=(1,))
    ids = np.array([4, 0, -1, 2])
    looked = cache.lookup(ids, seq_len=16)
    got = looked["teacher_logits"]
    batch = ds.gather(np.maximum(ids, 0), 16)
    out = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                      batch["token_type_ids"])
    ref = np.asarray(out.logits)
    spec = positions.lookup_spec(head, cfg.num_labels, batch, (1,), cfg.hidden_size)
    assert got.shape == ref.shape == spec["teacher_logits"].shape
    # PKD's [CLS] vectors of the asked layers, zeros for filler rows
    cls = np.asarray(out.hidden_states[1])[:, 0]
    assert looked["teacher_cls"].shape == spec["teacher_cls"].shape == (4, 1, 16)
    np.testing.assert_allclose(looked["teacher_cls"][[0, 1, 3], 0], cls[[0, 1, 3]], atol=1e-5)
    assert np.all(looked["teacher_cls"][2] == 0)
    for r, i in enumerate(ids):
        n = int(ds.lengths[i]) if i >= 0 else 0
        if head == "span":
            np.testing.assert_allclose(got[r, :, :n], ref[r, :, :n], atol=1e-5)
            assert np.all(got[r, :, n:] == heads.MASKED_LOGIT)
        else:
            np.testing.assert_allclose(got[r, :n], ref[r, :n], atol=1e-5)
            assert np.all(got[r, n:] == 0.0)


def test_store_shares_one_pass_between_runs(tmp_path, monkeypatch, caplog):
    """teacher/training.position_logits: later runs of the same teacher on the same rows (the KD
    and PKD baselines after the prediction stage) read the first one's logits and [CLS] vectors
    from the teacher store instead of a forward; another teacher or a damaged entry runs it."""
    from types import SimpleNamespace

    from jax_tinybert.teacher import store as teacher_store, training
    from test_teacher_cache import _TOKENIZER_DIR

    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    model = heads.MODELS["span"](cfg)
    ds = _dataset([3, 9, 16, 5, 12])
    data = SimpleNamespace(train_dataset=ds, head="span",
                           train_batches=SimpleNamespace(buckets=(8, 16)))
    store = teacher_store.Store(str(tmp_path / "store"))
    forwards = []
    real = positions.build
    monkeypatch.setattr(positions, "build", lambda *a, **k: forwards.append(1) or real(*a, **k))

    def run(seed, layers=(), where=store):
        models = SimpleNamespace(teacher=model, teacher_params=random_params(model, seed),
                                 teacher_config=cfg, tokenizer_dir=_TOKENIZER_DIR())
        return training.position_logits(models, SimpleNamespace(teacher_cls_layers=layers), data,
                                        4, where)

    first = run(0)
    assert first.cls is None   # the prediction stage reads no [CLS] vectors
    again = run(0)
    pkd = run(0, layers=(2, 1))
    assert len(forwards) == 1
    ids = np.arange(5)
    np.testing.assert_array_equal(again.lookup(ids, 16)["teacher_logits"],
                                  first.lookup(ids, 16)["teacher_logits"])
    # PKD's [CLS] vectors from the store, in its order: those of a forward without a store
    alone = run(0, layers=(2, 1), where=None)
    assert len(forwards) == 2
    np.testing.assert_array_equal(pkd.cls, alone.cls)
    assert pkd.cls.shape == (5, 2, 16)
    other = run(1)
    assert len(forwards) == 3
    assert not np.allclose(other.values, first.values)
    for p in (tmp_path / "store" / "positions").iterdir():
        p.write_bytes(b"not an npz")
    with caplog.at_level("WARNING"):
        np.testing.assert_array_equal(run(0).values, first.values)
    assert len(forwards) == 4 and "damaged entry" in caplog.text
