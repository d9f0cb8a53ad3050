"""Length buckets, per-process shards, exact resume, eval filler rows (docs/design.md, "Batches")."""
import numpy as np
import pytest

from jax_tinybert import data
from jax_tinybert.data import batching, tokenize

BUCKETS = (32, 64, 128)


@pytest.fixture(scope="module")
def tok(teacher_dir):
    return tokenize.load_tokenizer(teacher_dir)


@pytest.fixture(scope="module")
def sst2(glue_dir, tok):
    return tokenize.load_glue_encoded("sst2", "train", tok, 128, glue_dir=str(glue_dir))


@pytest.fixture(scope="module")
def mrpc(glue_dir, tok):
    return tokenize.load_glue_encoded("mrpc", "train", tok, 128, glue_dir=str(glue_dir))


def _check_contract(b, local_batch, labels_dtype=np.int32):
    T = b["input_ids"].shape[1]
    assert T in BUCKETS
    for k in ("input_ids", "attention_mask", "token_type_ids"):
        assert b[k].dtype == np.int32 and b[k].shape == (local_batch, T)
    assert b["labels"].dtype == labels_dtype and b["labels"].shape == (local_batch,)
    assert b["example_id"].dtype == np.int64 and b["valid"].dtype == np.float32
    assert b["example_id"].shape == b["valid"].shape == (local_batch,)


def test_sst2_buckets_only_configured_shapes_and_save_padding(sst2):
    it = batching.BucketedBatcher(sst2, 32, BUCKETS, seed=0, num_epochs=1,
                                  process_index=0, process_count=1)
    shapes, real, total = set(), 0, 0
    for b in it:
        _check_contract(b, 32)
        shapes.add(b["input_ids"].shape)
        real += int(b["attention_mask"].sum())
        total += b["input_ids"].size
        # every sequence is in the smallest bucket that fits
        n = b["attention_mask"].sum(1)
        T = b["input_ids"].shape[1]
        smaller = [x for x in BUCKETS if x < T]
        assert not smaller or n.max() > max(smaller)
    assert shapes <= {(32, t) for t in BUCKETS}
    w = batching.padding_waste(sst2.lengths, BUCKETS, fixed_len=128)
    print(f"\nSST-2 train padding waste: bucketed {w['bucketed']:.3f} vs fixed-128 {w['fixed']:.3f};"
          f" positions processed: {w['ratio']:.3f} of fixed-128 (measured over batches: "
          f"{total / (128 * len(it) * 32):.3f})")
    assert w["bucketed"] < w["fixed"] and w["ratio"] < 0.5
    assert 1 - real / total == pytest.approx(w["bucketed"], abs=0.02)


def test_shuffle_deterministic_by_seed_and_epoch(mrpc):
    mk = lambda seed: batching.BucketedBatcher(mrpc, 32, BUCKETS, seed=seed,  # noqa: E731
                                               process_index=0, process_count=1)
    a, b, c = mk(1), mk(1), mk(2)
    ids = lambda it, e: np.concatenate([it.batch_at(e, s)["example_id"]  # noqa: E731
                                        for s in range(it.steps_per_epoch)])
    np.testing.assert_array_equal(ids(a, 0), ids(b, 0))
    assert not np.array_equal(ids(a, 0), ids(c, 0))
    assert not np.array_equal(ids(a, 0), ids(a, 1))
    # within an epoch: no example twice; dropped only the incomplete tail of each bucket
    e0 = ids(a, 0)
    assert len(np.unique(e0)) == len(e0) > len(mrpc) - 32 * len(BUCKETS)


@pytest.mark.parametrize("train", [True, False])
def test_process_shards_are_disjoint_and_cover_the_global_batch(mrpc, train):
    P, G = 4, 32
    its = [batching.BucketedBatcher(mrpc, G, BUCKETS, train=train, seed=3, process_index=p,
                                    process_count=P) for p in range(P)]
    assert len({it.steps_per_epoch for it in its}) == 1
    seen = []
    for step in range(its[0].steps_per_epoch):
        parts = [it.batch_at(0, step) for it in its]
        for b in parts:
            _check_contract(b, G // P)
        assert len({b["input_ids"].shape for b in parts}) == 1  # same bucket on every process
        ids = np.concatenate([b["example_id"][b["valid"] > 0] for b in parts])
        plan = its[0].epoch_plan(0).rows[step]
        np.testing.assert_array_equal(np.sort(ids), np.sort(plan[plan >= 0]))
        seen.append(ids)
    seen = np.concatenate(seen)
    assert len(np.unique(seen)) == len(seen)  # disjoint across processes and steps
    if not train:  # eval: every example exactly once
        np.testing.assert_array_equal(np.sort(seen), np.arange(len(mrpc)))


def test_resume_gives_the_same_next_batch(mrpc):
    it = batching.BucketedBatcher(mrpc, 16, BUCKETS, seed=7, process_index=1, process_count=2)
    spe = it.steps_per_epoch
    for stop in (5, spe - 1, spe, spe + 3):  # mid-epoch, epoch end, across the boundary
        it.reset()
        for _ in range(stop):
            next(it)
        state = it.state_dict()
        expected = next(it)
        fresh = batching.BucketedBatcher(mrpc, 16, BUCKETS, seed=7, process_index=1,
                                         process_count=2)
        fresh.load_state_dict(state)
        got = next(fresh)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k])
    with pytest.raises(ValueError, match="seed"):
        batching.BucketedBatcher(mrpc, 16, BUCKETS, seed=8, process_index=1,
                                 process_count=2).load_state_dict(state)


def test_eval_mode_pads_last_batch_with_invalid_filler(glue_dir, tok):
    evals = data.glue_eval_iterators("mrpc", str(glue_dir), tok, global_batch_size=48,
                                     process_index=0, process_count=1)
    it = evals["dev"]
    batches = list(it)
    assert len(batches) == it.steps_per_epoch and len(list(it)) == 0  # one pass
    for b in batches:
        _check_contract(b, 48)
        filler = b["valid"] == 0
        assert np.all(b["example_id"][filler] == -1)
        assert np.all(b["attention_mask"][filler].sum(1) > 0)  # filler rows are real-looking
    valid = np.concatenate([b["valid"] for b in batches])
    assert valid.sum() == 408 and (valid == 0).sum() > 0
    ids = np.concatenate([b["example_id"] for b in batches])
    assert np.all(np.diff(ids[ids >= 0][:10]) > 0)  # not shuffled
    it.reset()
    assert len(list(it)) == len(batches)


def test_stsb_regression_labels_and_entry_point(glue_dir, tok, tmp_path):
    it = data.glue_train_iterator("STS-B", str(glue_dir), tok, global_batch_size=32, max_len=64,
                                  cache_dir=str(tmp_path), process_index=0, process_count=1)
    b = next(it)
    assert b["labels"].dtype == np.float32
    assert b["input_ids"].shape[1] in (32, 64)
    assert data.buckets_for(64) == (32, 64)


def test_bad_configuration_errors(mrpc):
    with pytest.raises(ValueError, match="divisible"):
        batching.BucketedBatcher(mrpc, 30, BUCKETS, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="largest bucket"):
        batching.BucketedBatcher(mrpc, 32, (32, 64), process_index=0, process_count=1)


def _brute_force_buckets(lengths, max_len, k, multiple=8, attention_len=256):
    """Every set of <= k candidate lengths (last one covering the longest example): the cheapest."""
    import itertools

    top = min(max_len, -(-int(lengths.max()) // multiple) * multiple)
    cands = sorted({c for c in range(multiple, top, multiple)} | {top})
    best = None
    for r in range(0, k):
        for combo in itertools.combinations(cands[:-1], r):
            bs = tuple(combo) + (top,)
            t = np.asarray(bs)[np.searchsorted(bs, lengths)]
            cost = float(np.sum(t + t * t / attention_len))
            if best is None or cost < best[0] - 1e-9:
                best = (cost, bs)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choose_buckets_is_the_cheapest_set_within_the_budget(seed):
    r = np.random.default_rng(seed)
    lengths = np.concatenate([r.integers(3, 20, 300), r.integers(20, 70, 60)])
    for k in (1, 2, 3):
        got = batching.choose_buckets(lengths, 72, max_buckets=k, tolerance=0.0)
        want_cost, want = _brute_force_buckets(lengths, 72, k)
        assert got[-1] == 72 and len(set(got) - {72}) <= k
        assert batching.bucket_cost(lengths, got) == pytest.approx(want_cost, rel=1e-12), (got, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_choose_buckets_weighs_compilations_against_padding(seed):
    """With compile_cost the count is the one minimising passes x cost + k x compile_cost
    (brute force over every set of each size), not the most buckets that pay."""
    r = np.random.default_rng(seed)
    lengths = np.concatenate([r.integers(3, 20, 200), r.integers(20, 70, 40)])
    full = _brute_force_buckets(lengths, 72, 4)[0]
    for passes, cc in ((1, 0.05 * full), (3, 0.05 * full), (1, 2 * full), (2, 0.0)):
        totals = {k: passes * _brute_force_buckets(lengths, 72, k)[0] + k * cc
                  for k in range(1, 5)}
        want_k = min(totals, key=lambda k: (totals[k], k))
        got = batching.choose_buckets(lengths, 72, max_buckets=4, tolerance=0.0, passes=passes,
                                      compile_cost=cc)
        used = set(np.asarray(got)[batching.assign_buckets(lengths, got)].tolist())
        assert len(used) == want_k, (passes, cc, got, totals)
        assert passes * batching.bucket_cost(lengths, got) + len(used) * cc == \
            pytest.approx(totals[want_k], rel=1e-12)


def test_choose_buckets_compile_cost_by_hand():
    # 10 examples of 8 tokens, 10 of 64. One bucket (64): 20 x (64 + 64^2/256) = 1600 per pass;
    # two (8, 64): 10 x (8 + 0.25) + 10 x 80 = 882.5 per pass.
    lengths = np.asarray([8] * 10 + [64] * 10)
    # one pass, a compilation worth 1000: 1600 + 1000 < 882.5 + 2000 -> one bucket
    assert batching.choose_buckets(lengths, 64, passes=1, compile_cost=1000.0) == (64,)
    # two passes: 3200 + 1000 > 1765 + 2000 -> two
    assert batching.choose_buckets(lengths, 64, passes=2, compile_cost=1000.0) == (8, 64)
    assert batching.compile_cost(2, 10, 64) == 2 * 10 * 80.0
    with pytest.raises(ValueError, match="passes"):
        batching.choose_buckets(lengths, 64, passes=0)


def test_resume_with_other_buckets_is_refused(mrpc):
    it = batching.BucketedBatcher(mrpc, 32, (64, 128), seed=1, process_index=0, process_count=1)
    next(it)
    other = batching.BucketedBatcher(mrpc, 32, (48, 128), seed=1, process_index=0,
                                     process_count=1)
    with pytest.raises(ValueError, match=r"buckets=\(64, 128\).*data.buckets"):
        other.load_state_dict(it.state_dict())
    same = batching.BucketedBatcher(mrpc, 32, (64, 128), seed=1, process_index=0, process_count=1)
    old = {k: v for k, v in it.state_dict().items() if k != "buckets"}  # saved before buckets
    same.load_state_dict(old)
    assert same.step == 1


def test_choose_buckets_on_sst2_halves_the_padding_and_keeps_every_example(sst2):
    lengths = np.asarray(sst2.lengths)
    buckets = batching.choose_buckets(lengths, 128, max_buckets=6)
    assert buckets[-1] == 128 and len(buckets) <= 7 and all(b % 8 == 0 for b in buckets)
    padded = lambda bs: np.asarray(bs)[batching.assign_buckets(lengths, bs)].mean()  # noqa: E731
    assert padded(buckets) < 0.55 * padded((32, 64, 128))  # SST-2: 33.8 -> ~17 tokens/example
    # The batcher's semantics are unchanged: with drop_remainder=False one epoch holds every
    # example exactly once, the plan is deterministic, and its position resumes exactly.
    ds = sst2
    it = batching.BucketedBatcher(ds, 64, buckets, seed=3, num_epochs=1, drop_remainder=False,
                                  process_index=0, process_count=1)
    plan = it.epoch_plan(0)
    rows = plan.rows[plan.rows >= 0]
    assert np.array_equal(np.sort(rows), np.arange(len(ds)))
    again = batching.BucketedBatcher(ds, 64, buckets, seed=3, num_epochs=1,
                                     drop_remainder=False, process_index=0, process_count=1)
    assert np.array_equal(again.epoch_plan(0).rows, plan.rows)
    for _ in range(5):
        next(it)
    resumed = batching.BucketedBatcher(ds, 64, buckets, seed=3, num_epochs=1,
                                       drop_remainder=False, process_index=0, process_count=1)
    resumed.load_state_dict(it.state_dict())
    a, b = next(it), next(resumed)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_resolve_buckets_configured_or_auto():
    assert batching.resolve_buckets((32, 64, 128), 64) == (32, 64)
    lengths = np.asarray([5, 6, 7, 30, 31, 60])
    auto = batching.resolve_buckets((), 64, lengths, max_buckets=3)
    assert auto == batching.choose_buckets(lengths, 64, 3) and auto[-1] == 64
    with pytest.raises(ValueError, match="max_len"):
        batching.choose_buckets(np.asarray([70]), 64)
