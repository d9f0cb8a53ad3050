"""Packed rows (several examples per row): the plan, the in-program inputs against NumPy, and a
packed teacher pass against PyTorch `transformers` on each example alone."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_tinybert.teacher import cache as tc

from jax_tinybert.teacher import training as tt
from jax_tinybert.data import packing
from jax_tinybert.data.tokenize import EncodedDataset
from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, BertModel, random_params


def _random_ds(lengths, vocab=100, seed=0, pairs=False):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=int(np.sum(lengths))).astype(np.int32)
    tt = np.zeros_like(ids, np.int8)
    offs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if pairs:   # second half of each example is segment B, as in MRPC
        for a, e in zip(offs[:-1], offs[1:]):
            tt[(a + e) // 2:e] = 1
    return EncodedDataset(ids, tt, offs, None, 0)


def _tiny_classifier(num_labels, seed):
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, num_labels=num_labels)
    model = BertForSequenceClassification(cfg)
    return model, random_params(model, seed)


def test_pack_places_every_example_once_within_limits():
    lens = np.random.default_rng(1).integers(1, 40, size=500)
    rows = packing.pack(lens, 64, 5)
    flat = np.concatenate(rows)
    assert sorted(flat.tolist()) == list(range(500))
    assert all(lens[r].sum() <= 64 and 1 <= len(r) <= 5 for r in rows)
    # Best fit decreasing fills rows: fewer than 1.1x the lower bound on rows.
    assert len(rows) < 1.1 * max(lens.sum() / 64, 500 / 5)
    assert [r.tolist() for r in rows] == [r.tolist() for r in packing.pack(lens, 64, 5)]


def test_pack_refuses_an_example_longer_than_the_row():
    with pytest.raises(ValueError, match="example 2 has 70 tokens; a packed row holds 1..64"):
        packing.pack(np.array([3, 5, 70]), 64, 4)
    with pytest.raises(ValueError, match="max_segments=0"):
        packing.pack(np.array([3]), 64, 0)


def test_model_inputs_against_numpy():
    lens = np.array([5, 3, 9, 2, 7, 4])
    ds = _random_ds(lens)
    rows = packing.pack(lens, 16, 3)
    (batch,) = list(packing.packed_batches(ds, rows, 16, 3, batch_rows=len(rows) + 1))
    mask, pos, cls = jax.jit(packing.model_inputs, static_argnums=1)(batch["attention_mask"], 3)
    R = len(rows) + 1
    want_mask = np.zeros((R, 16, 16), np.int32)
    want_pos = np.zeros((R, 16), np.int32)
    want_cls = np.zeros((R, 3), np.int32)
    for r, members in enumerate(rows):   # written from the layout, token by token
        t = 0
        for s, i in enumerate(members):
            n = lens[i]
            want_mask[r, t:t + n, t:t + n] = 1
            want_pos[r, t:t + n] = np.arange(n)
            want_cls[r, s] = t
            assert batch["example_id"][r * 3 + s] == i
            np.testing.assert_array_equal(batch["input_ids"][r, t:t + n],
                                          ds.input_ids[ds.offsets[i]:ds.offsets[i + 1]])
            t += n
    np.testing.assert_array_equal(np.asarray(mask), want_mask)
    np.testing.assert_array_equal(np.asarray(pos), want_pos)
    np.testing.assert_array_equal(np.asarray(cls), want_cls)
    assert batch["valid"].sum() == len(lens) and (batch["example_id"] >= 0).sum() == len(lens)


@pytest.mark.parametrize("cls_only", [True, False])
def test_packed_teacher_pass_matches_pytorch_per_example(teacher_dir, cls_only):
    """The packed forward's pooled output and [CLS] vectors of every layer, against PyTorch
    `transformers` on each example alone (no padding, no packing)."""
    import torch
    from transformers import BertModel as TorchBert

    import jax_tinybert as jtb

    config, params = jtb.load_pretrained(teacher_dir)
    lens = np.array([12, 4, 30, 7, 9, 3, 21, 16, 5])
    ds = _random_ds(lens, vocab=config.vocab_size, seed=3, pairs=True)
    layers = tuple(range(config.num_hidden_layers + 1))
    feats = lambda out: {"pooled": out.pooled,
                         "cls": jnp.stack([out.hidden_states[i][:, 0] for i in layers], axis=1)}
    rows = packing.pack(lens, 32, 4)
    assert max(len(r) for r in rows) > 1
    fwd = tc.make_forward(BertModel(config), feats, cls_only=cls_only, packed_segments=4)
    got = {}
    for batch in packing.packed_batches(ds, rows, 32, 4, batch_rows=2):
        out = fwd(params, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        for j, i in enumerate(batch["example_id"]):
            if i >= 0:
                got[int(i)] = (np.asarray(out["pooled"][j]), np.asarray(out["cls"][j]))
    assert sorted(got) == list(range(len(lens)))
    ref = TorchBert.from_pretrained(teacher_dir, attn_implementation="eager").eval()
    for i in range(len(lens)):
        a, e = ds.offsets[i], ds.offsets[i + 1]
        with torch.no_grad():
            r = ref(input_ids=torch.tensor(ds.input_ids[a:e][None], dtype=torch.long),
                    token_type_ids=torch.tensor(ds.token_type_ids[a:e][None], dtype=torch.long),
                    output_hidden_states=True)
        np.testing.assert_allclose(got[i][0], r.pooler_output[0].numpy(), atol=1e-4,
                                   err_msg=f"pooled, example {i}")
        np.testing.assert_allclose(got[i][1], np.stack([h[0, 0].numpy() for h in r.hidden_states]),
                                   atol=1e-4, err_msg=f"[CLS] vectors, example {i}")


def test_packed_pass_equals_bucketed_pass_over_a_subset():
    """`build_for_training`'s two ways of forwarding rows of a dataset (packed rows, buckets)
    give each example's logits and [CLS] vectors at the same place."""
    model, params = _tiny_classifier(num_labels=3, seed=0)
    lens = np.random.default_rng(2).integers(3, 14, size=60)
    ds = _random_ds(lens, seed=4)
    rows = np.sort(np.random.default_rng(5).choice(60, size=41, replace=False))
    plan = tt.packing_plan(lens[rows], (16, 32, 64))
    assert plan is not None and plan[0] in (16, 32, 64) and plan[1] > 1
    packed = tt._forward_rows(tc.make_forward(model, cls_layers=(1, 2),
                                              packed_segments=plan[1]),
                              params, tt._packed_row_batches(ds, rows, plan, 8), rows)
    plain = tt._forward_rows(tc.make_forward(model, cls_layers=(1, 2)), params,
                             tt._row_batches(ds, rows, (16, 32, 64), 8), rows)
    assert set(packed) == set(plain) == {"teacher_logits", "teacher_cls"}
    for k in plain:
        np.testing.assert_allclose(packed[k], plain[k], atol=1e-5, err_msg=k)
        assert np.abs(plain[k]).min(axis=tuple(range(1, plain[k].ndim))).all()  # every row set


def test_packing_plan_chooses_by_cost():
    short = np.random.default_rng(0).integers(3, 11, size=600)
    P, S, rows = tt.packing_plan(short, (8, 16, 32, 64))
    assert P in (16, 32, 64) and S > 1 and sorted(np.concatenate(rows)) == list(range(600))
    unit = lambda t: t * (1 + t / tc.PACK_ATTENTION_LEN)
    bucketed = sum(unit(8 if n <= 8 else 16) for n in short)
    assert len(rows) * unit(P) <= tt.PACK_GAIN * bucketed
    for Q in (16, 32, 64):   # the cheapest of the row lengths that hold every example
        assert len(rows) * unit(P) <= len(packing.pack(short, Q, Q // 4)) * unit(Q)
    long_pairs = np.random.default_rng(0).integers(65, 120, size=200)
    assert tt.packing_plan(long_pairs, (64, 128)) is None   # ~1 example per row of 128
    assert tt.packing_plan(np.array([70]), (16, 64)) is None   # longer than every bucket


def test_cache_built_from_packed_rows_equals_live_forward(tmp_path):
    """A cache written from packed batches (`tc.build`, as `build_for_training` runs it): every
    example's stored logits and [CLS] vectors are those of the unpacked forward on its own."""
    model, params = _tiny_classifier(num_labels=2, seed=1)
    lens = np.random.default_rng(6).integers(3, 12, size=45)
    ds = _random_ds(lens, seed=7)
    plan = tt.packing_plan(lens, (16, 32))
    assert plan is not None
    cache = tc.build(str(tmp_path / "c"), {"t": 1}, tc.make_forward(
        model, cls_layers=(0, 2), packed_segments=plan[1]), params,
        tt._packed_row_batches(ds, None, plan, 8), len(lens))
    got = cache.lookup(np.arange(len(lens)))
    live = tc.make_forward(model, cls_layers=(0, 2))
    for i in range(len(lens)):
        a, e = ds.offsets[i], ds.offsets[i + 1]
        x = ds.input_ids[a:e][None]
        want = live(params, x, np.ones_like(x), np.zeros_like(x))
        np.testing.assert_allclose(got["teacher_logits"][i], want["teacher_logits"][0], atol=1e-5)
        np.testing.assert_allclose(got["teacher_cls"][i], want["teacher_cls"][0], atol=1e-5)


def test_a_passes_work_is_what_its_batches_add_up_to():
    """The teacher pass's progress: the work of the batches `build_for_training` forwards (packed
    rows, or buckets over a subset with filler rows) adds up to `pass_work` exactly, so the
    percentage ends at 100%; and per batch it is rows x (T + T^2 / 512), written out by hand."""
    lens = np.random.default_rng(8).integers(3, 30, size=300)
    ds = _random_ds(lens, seed=9)
    rows = np.sort(np.random.default_rng(10).choice(300, size=217, replace=False))
    buckets = (16, 32)
    plan = tt.packing_plan(lens[rows], buckets)
    assert plan is not None
    for batches, total in ((tt._packed_row_batches(ds, rows, plan, 8),
                            tc.pass_work(lens[rows], buckets, plan)),
                           (tt._row_batches(ds, rows, buckets, 8),
                            tc.pass_work(lens[rows], buckets))):
        done = 0.0
        for b in batches:
            R, T = b["input_ids"].shape
            keep = b["example_id"] >= 0
            w = tc.forward_work(keep, R, T)
            by_hand = sum(1 for r in keep.reshape(R, -1) if r.any()) * (T + T * T / 512.0)
            assert w == pytest.approx(by_hand)
            done += w
        assert done == pytest.approx(total, rel=1e-12)
    assert tc.pass_work(lens[rows], buckets, plan) == pytest.approx(
        len(plan[2]) * (plan[0] + plan[0] ** 2 / 512.0))
    in_buckets = [16 if n <= 16 else 32 for n in lens[rows]]
    assert tc.pass_work(lens[rows], buckets) == pytest.approx(
        sum(t + t * t / 512.0 for t in in_buckets))
