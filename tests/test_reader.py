"""The corpus reader (data/reader.py): one global order split by process, resume on another
process count from the saved Grain state, rows read in place equal rows in memory, a prepared
folder in a bucket copied once, damaged and missing shards named."""
import json
import os
import shutil

import numpy as np
import pytest

from jax_tinybert.data import prepare, prepared, reader, tokenize

SEQ = 32


def _dataset(n=1003, seed=0):
    """Rows of 3-16 tokens whose ids encode (row, position): row r holds r * 100 + j."""
    lens = np.random.default_rng(seed).integers(3, 17, n)
    ids = np.concatenate([r * 100 + np.arange(k) for r, k in enumerate(lens)]).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return tokenize.EncodedDataset(ids, np.zeros(len(ids), np.int8), offsets, None, 0)


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_every_step_is_one_global_batch_split_by_process():
    ds = _dataset()
    g, steps = 16, 62                                  # 1003 // 16 = 62 steps an epoch
    one = _take(reader.CorpusBatcher(ds, g, SEQ, seed=5, process_count=1, process_index=0),
                2 * steps + 7)
    for P in (2, 4):
        parts = [_take(reader.CorpusBatcher(ds, g, SEQ, seed=5, process_index=p,
                                            process_count=P), 2 * steps + 7) for p in range(P)]
        for t, ref in enumerate(one):
            got = np.concatenate([parts[p][t]["example_id"] for p in range(P)])
            np.testing.assert_array_equal(got, ref["example_id"])
            np.testing.assert_array_equal(
                np.concatenate([parts[p][t]["input_ids"] for p in range(P)]), ref["input_ids"])
    for epoch in range(2):
        rows = np.concatenate([b["example_id"] for b in one[epoch * steps:(epoch + 1) * steps]])
        assert len(set(rows.tolist())) == steps * g        # no row twice in an epoch
    e0 = np.concatenate([b["example_id"] for b in one[:steps]])
    e1 = np.concatenate([b["example_id"] for b in one[steps:2 * steps]])
    assert (e0 != e1).mean() > 0.9                         # each epoch its own shuffle
    # The batch holds the rows it names: row r's tokens are r * 100 + j, padded with 0.
    b = one[3]
    for r, row in zip(b["example_id"], b["input_ids"]):
        n = int(ds.lengths[r])
        np.testing.assert_array_equal(row[:n], r * 100 + np.arange(n))
        assert not row[n:].any() and b["attention_mask"][list(b["example_id"]).index(r)].sum() == n
    assert b["valid"].all() and b["input_ids"].dtype == np.int32


@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (2, 4), (4, 1)])
def test_resume_on_another_process_count_continues_the_same_steps(saved_on, resumed_on):
    ds, g, k = _dataset(), 16, 59          # saved 3 steps before the epoch's end
    unbroken = _take(reader.CorpusBatcher(ds, g, SEQ, seed=2, process_index=0, process_count=1),
                     k + 8)
    its = [reader.CorpusBatcher(ds, g, SEQ, seed=2, process_index=p, process_count=saved_on)
           for p in range(saved_on)]
    for it in its:
        _take(it, k)
    states = [json.loads(json.dumps(it.state_dict())) for it in its]   # checkpoint metadata
    assert all(s == states[0] for s in states)             # the same on every process
    assert states[0]["grain"] == {"next_index": k} and (states[0]["epoch"], states[0]["step"]) == (0, k)
    new = [reader.CorpusBatcher(ds, g, SEQ, seed=2, process_index=p, process_count=resumed_on)
           for p in range(resumed_on)]
    for it in new:
        it.load_state_dict(states[0])
    after = [_take(it, 8) for it in new]
    for t in range(8):
        np.testing.assert_array_equal(
            np.concatenate([after[p][t]["example_id"] for p in range(resumed_on)]),
            unbroken[k + t]["example_id"])


def test_a_resume_with_other_data_or_batch_is_refused():
    ds = _dataset()
    it = reader.CorpusBatcher(ds, 16, SEQ, seed=1, process_index=0, process_count=1)
    _take(it, 3)
    state = it.state_dict()
    for kw, what in ((dict(seed=2), "seed"), (dict(global_batch_size=32), "global_batch_size")):
        args = dict(dict(seed=1, global_batch_size=16), **kw)
        other = reader.CorpusBatcher(ds, args.pop("global_batch_size"), SEQ, process_index=0,
                                     process_count=1, **args)
        with pytest.raises(ValueError, match=what):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="num_examples"):
        reader.CorpusBatcher(_dataset(900), 16, SEQ, seed=1, process_index=0,
                             process_count=1).load_state_dict(state)
    with pytest.raises(ValueError, match="disagrees"):
        it.load_state_dict(dict(state, grain={"next_index": 7}))
    with pytest.raises(ValueError, match="no full batch"):
        reader.CorpusBatcher(_dataset(10), 16, SEQ, process_index=0, process_count=1)


@pytest.fixture(scope="module")
def tok(teacher_dir):
    return tokenize.load_data_tokenizer(teacher_dir)


@pytest.fixture(scope="module")
def prep(tmp_path_factory, shared_dir, tok):
    """Two books prepared at seq_len 32 in shards of 500 rows."""
    books = [str(shared_dir / "data" / "corpus" / n) for n in
             ("gutenberg_pg1656_plato_apology_jowett.txt",
              "gutenberg_pg1974_aristotle_poetics_butcher.txt")]
    out = str(tmp_path_factory.mktemp("reader") / "prep")
    prepare.prepare(books, out, tok, prepare.Settings(seq_len=SEQ, rows_per_shard=500))
    return out


@pytest.fixture
def local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "jax_tinybert" / "prepared"


def test_rows_read_in_place_equal_rows_in_memory(prep, tok, local_cache):
    mem = prepared.open_rows(prep, tok, SEQ, memory_tokens=1 << 30)
    disk = prepared.open_rows(prep, tok, SEQ, memory_tokens=0)
    assert isinstance(mem, tokenize.EncodedDataset) and isinstance(disk, reader.PreparedRows)
    assert len(disk) == len(mem) and len(disk.files) > 1
    np.testing.assert_array_equal(disk.lengths, mem.lengths)
    rows = np.random.default_rng(0).permutation(len(mem))[:300]
    rows[-1] = len(mem) - 1                                # the short last row
    a, b = mem.gather(rows, SEQ), disk.gather(rows, SEQ)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    its = [reader.CorpusBatcher(x, 64, SEQ, seed=3, process_index=0, process_count=1)
           for x in (mem, disk)]
    for _ in range(5):
        x, y = next(its[0]), next(its[1])
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    sub = reader.SubsetRows(disk, np.array([5, 9, 2]))
    np.testing.assert_array_equal(sub.gather(np.array([2, 0]), SEQ)["input_ids"],
                                  mem.gather(np.array([2, 5]), SEQ)["input_ids"])
    assert sub.fingerprint != disk.fingerprint


def test_worker_processes_read_the_same_batches_and_resume(prep, tok, local_cache):
    """data.read_workers=2: Grain's worker processes give the batches the threads give, and a
    resume from their saved state continues them."""
    rows = prepared.open_rows(prep, tok, SEQ, memory_tokens=0)
    ref = reader.CorpusBatcher(rows, 32, SEQ, seed=4, process_index=1, process_count=2)
    mp = reader.CorpusBatcher(rows, 32, SEQ, seed=4, process_index=1, process_count=2,
                              read_workers=2)
    try:
        want = _take(ref, 9)
        got = _take(mp, 6)
        state = mp.state_dict()
        again = reader.CorpusBatcher(rows, 32, SEQ, seed=4, process_index=1, process_count=2,
                                     read_workers=2)
        again.load_state_dict(state)
        got += _take(again, 3)
    finally:
        mp._close()
        again._close()
    assert state["grain"] == {"next_index": 6}
    for x, y in zip(got, want):
        for k in y:
            np.testing.assert_array_equal(x[k], y[k])


def test_damaged_or_missing_shards_are_named(prep, tok, tmp_path, local_cache):
    copy = str(tmp_path / "copy")
    shutil.copytree(prep, copy)
    prepared.open_rows(copy, tok, SEQ)                      # verified once: a stamp
    assert len(os.listdir(local_cache / "verified")) == 1
    shard = sorted(f for f in os.listdir(copy) if f.endswith(".array_record"))[1]
    with open(os.path.join(copy, shard), "r+b") as f:      # same size, one byte changed
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(prepared.PreparedError, match=f"shard {shard} is damaged"):
        prepared.open_rows(copy, tok, SEQ)
    os.remove(os.path.join(copy, shard))
    with pytest.raises(prepared.PreparedError, match=f"shard {shard} is missing"):
        prepared.open_rows(copy, tok, SEQ)
    with pytest.raises(prepared.PreparedError, match="seq_len=32, the run has data.seq_len=64"):
        prepared.open_rows(prep, tok, 64)


def test_a_prepared_folder_in_a_bucket_is_copied_to_local_disk_once(prep, tok, local_cache,
                                                                    monkeypatch):
    from helpers import gcs_emulator

    if gcs_emulator.available() is not None:
        pytest.skip(str(gcs_emulator.available()))
    from jax_tinybert import fs

    with gcs_emulator.running():
        fsys, _ = fs.url_fs(f"gs://{gcs_emulator.BUCKET}")
        for f in os.listdir(prep):
            fsys.pipe_file(f"{gcs_emulator.BUCKET}/prep/{f}",
                           open(os.path.join(prep, f), "rb").read())
        url = f"gs://{gcs_emulator.BUCKET}/prep"
        assert prepared.is_prepared(url)
        reads = []
        real_open = fs.open_file
        monkeypatch.setattr(fs, "open_file", lambda p, *a, **k: (reads.append(p),
                                                                 real_open(p, *a, **k))[1])
        first = prepared.open_rows(url, tok, SEQ, memory_tokens=0)
        n_first = len(reads)
        second = prepared.open_rows(url, tok, SEQ, memory_tokens=0)
    assert n_first == len(json.load(open(os.path.join(prep, "manifest.json")))["shards"]) + 1
    assert len(reads) == n_first + 1                        # the manifest only
    assert first.path == second.path and first.path.startswith(str(local_cache))
    rows = np.arange(0, len(first), 7)
    np.testing.assert_array_equal(first.gather(rows, SEQ)["input_ids"],
                                  prepared.open_rows(prep, tok, SEQ).gather(rows, SEQ)["input_ids"])
    assert not [n for n in os.listdir(local_cache) if n.startswith(".")]   # no temporary left
