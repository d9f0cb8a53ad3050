"""The prepare step: sources, packing against an independent reference, duplicates, N workers
equal to one, a run reading the prepared rows, one-line errors, interrupted and failed runs."""
import bz2
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_tinybert.data import corpus, prepare, prepared, tokenize
from jax_tinybert.errors import one_line, tool_exit

SEQ = 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok(teacher_dir):
    return tokenize.load_data_tokenizer(teacher_dir)


def _settings(**kw):
    return prepare.Settings(**dict(dict(seq_len=SEQ, rows_per_shard=7), **kw))


def _reference_rows(docs, tok, seq_len=SEQ, dedup=True):
    """Independent packing: each document's lines joined by spaces and tokenized as one text
    (the first of exact duplicates kept), a [SEP] after each, cut into [CLS] chunk [SEP]."""
    seen, stream = set(), []
    for lines in docs:
        key = tuple(lines)
        if dedup and key in seen:
            continue
        seen.add(key)
        ids = tok(" ".join(lines), add_special_tokens=False)["input_ids"]
        if ids:
            stream += ids + [tok.sep_token_id]
    n = seq_len - 2
    return [[tok.cls_token_id] + stream[i:i + n] + [tok.sep_token_id]
            for i in range(0, len(stream), n)]


def _rows(out):
    """The prepared rows read straight from the ArrayRecord files: (bytes per row, ids)."""
    from array_record.python.array_record_module import ArrayRecordReader

    m = json.load(open(os.path.join(out, "manifest.json")))
    recs = []
    for s in m["shards"]:
        r = ArrayRecordReader(os.path.join(out, s["file"]))
        recs += r.read_all()
        r.close()
    return recs, [np.frombuffer(b, "<u2").tolist() for b in recs]


WIKI = """<doc id="1" url="https://en.wikipedia.org/wiki?curid=1" title="Alpha">
Alpha
Alpha is the first letter of the Greek alphabet.
It comes before beta.

In the system of Greek numerals it has a value of one.
</doc>
<doc id="2" url="https://en.wikipedia.org/wiki?curid=2" title="Beta">
Beta
Beta is the second letter.
</doc>
"""
WIKI_DOCS = [["Alpha", "Alpha is the first letter of the Greek alphabet.", "It comes before beta."],
             ["In the system of Greek numerals it has a value of one."],
             ["Beta", "Beta is the second letter."]]


def test_local_tree_wikiextractor_txt_gz_bz2(tmp_path, tok):
    root = tmp_path / "wiki"
    (root / "AA").mkdir(parents=True)
    (root / "AB" / "deep").mkdir(parents=True)
    (root / "AA" / "wiki_00").write_text(WIKI)
    (root / "AA" / "wiki_01.bz2").write_bytes(bz2.compress(WIKI.replace("Alpha", "Gamma").encode()))
    (root / "AB" / "deep" / "notes.txt.gz").write_bytes(gzip.compress(
        "\ufeffFirst note line.\r\nSecond line.\r\n\r\n\r\nA new note.\r\n".encode()))
    (root / "AB" / "README.md").write_text("not corpus text")
    # wiki_01 repeats two of wiki_00's paragraphs (the second and the Beta article): dropped.
    docs = WIKI_DOCS + [[s.replace("Alpha", "Gamma") for s in WIKI_DOCS[0]]] + WIKI_DOCS[1:] + \
        [["First note line.", "Second line."], ["A new note."]]
    m = prepare.prepare([str(root)], str(tmp_path / "out"), tok, _settings())
    recs, rows = _rows(tmp_path / "out")
    assert rows == _reference_rows(docs, tok)
    assert m["counts"]["documents"] == 8 and m["counts"]["duplicates_dropped"] == 2
    assert m["dtype"] == "uint16" and all(len(r) == 2 * len(x) for r, x in zip(recs, rows))
    assert [f["name"] for f in m["source_identity"][0]["files"]] == [
        "AA/wiki_00", "AA/wiki_01.bz2", "AB/deep/notes.txt.gz"]
    # Content, not paths: the same files elsewhere give the same key.
    shutil.copytree(root, tmp_path / "moved")
    os.utime(tmp_path / "moved" / "AA" / "wiki_00", (1, 1))     # touched: hashed again
    again = prepare.prepare([str(tmp_path / "moved")], str(tmp_path / "out"), tok, _settings())
    assert again["key"] == m["key"] and again["created"] == m["created"]    # reused
    # documents mode: one document per line.
    m2 = prepare.prepare([str(root / "AA" / "wiki_00")], str(tmp_path / "docs"), tok,
                         _settings(mode="documents"))
    assert _rows(tmp_path / "docs")[1] == _reference_rows(
        [[x] for d in WIKI_DOCS for x in d], tok)
    assert m2["key"] != m["key"]


def test_bucket_sources(tmp_path, tok):
    from helpers import gcs_emulator

    if gcs_emulator.available() is not None:
        pytest.skip(str(gcs_emulator.available()))
    local = tmp_path / "corpus"
    (local / "AA").mkdir(parents=True)
    (local / "AA" / "wiki_00").write_text(WIKI)
    (local / "AA" / "notes.txt.gz").write_bytes(gzip.compress(b"A note.\n\nAnother one.\n"))
    (local / "AA" / "skip.md").write_text("not corpus text")
    want = prepare.prepare([str(local)], str(tmp_path / "local"), tok, _settings())
    with gcs_emulator.running():
        from jax_tinybert import fs

        fsys, _ = fs.url_fs(f"gs://{gcs_emulator.BUCKET}")
        for f in ("AA/wiki_00", "AA/notes.txt.gz", "AA/skip.md"):
            fsys.pipe_file(f"{gcs_emulator.BUCKET}/corpus/{f}", (local / f).read_bytes())
        url = f"gs://{gcs_emulator.BUCKET}/corpus"
        m = prepare.prepare([url], str(tmp_path / "gs"), tok, _settings())
        g = prepare.prepare([url + "/*/wiki_*"], str(tmp_path / "glob"), tok, _settings())
    assert _rows(tmp_path / "gs")[0] == _rows(tmp_path / "local")[0]
    assert [f["name"] for f in m["source_identity"][0]["files"]] == ["AA/notes.txt.gz",
                                                                     "AA/wiki_00"]
    assert all(f.get("digest") for f in m["source_identity"][0]["files"])   # the bucket's hash
    assert g["counts"]["documents"] == 3 and want["counts"]["documents"] == 5


RECORDS = [{"id": 1, "text": "The first record.\nIts second line."},
           {"id": 2, "text": "Another record entirely."},
           {"id": 3, "text": "The first record.\nIts second line."},
           {"id": 4, "text": "  \n  "},
           {"id": 5, "text": "Blank lines\n\ninside stay one document."}]
RECORD_DOCS = [["The first record.", "Its second line."], ["Another record entirely."],
               ["Blank lines", "inside stay one document."]]


def _jsonl(records, field="text"):
    return "".join(json.dumps({(field if k == "text" else k): v for k, v in r.items()}) + "\n"
                   for r in records)


def test_jsonl_gz_and_text_field(tmp_path, tok):
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.jsonl").write_text(_jsonl(RECORDS[:3]))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(RECORDS[3:]).encode()))
    m = prepare.prepare([str(d)], str(tmp_path / "out"), tok, _settings())
    assert _rows(tmp_path / "out")[1] == _reference_rows(RECORD_DOCS, tok)
    assert m["counts"] == {"documents": 4, "duplicates_dropped": 1, "documents_without_tokens": 0,
                           "documents_kept": 3}
    (tmp_path / "body.jsonl").write_text(_jsonl(RECORDS, field="body"))
    prepare.prepare([str(tmp_path / "body.jsonl")], str(tmp_path / "body"), tok,
                    _settings(text_field="body", dedup=False))
    assert _rows(tmp_path / "body")[1] == _reference_rows(
        [RECORD_DOCS[0], RECORD_DOCS[1], RECORD_DOCS[0], RECORD_DOCS[2]], tok, dedup=False)


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_dataset_over_local_files(tmp_path, tok, monkeypatch, streaming):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    pytest.importorskip("datasets")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text(_jsonl(RECORDS))
    spec = f"hf:json?data_files={tmp_path / 'd' / 'train.jsonl'}&streaming={int(streaming)}"
    m = prepare.prepare([spec], str(tmp_path / "out"), tok, _settings())
    assert _rows(tmp_path / "out")[1] == _reference_rows(RECORD_DOCS, tok)
    assert m["counts"]["duplicates_dropped"] == 1
    assert m["source_identity"][0]["files"][0]["name"] == "train.jsonl"
    with pytest.raises(prepare.src.SourceError, match="no column 'body'|no field 'body'"):
        prepare.prepare([spec], str(tmp_path / "bad"), tok, _settings(text_field="body"))


def test_tfds_source(tmp_path, tok, monkeypatch):
    """tensorflow-datasets is not installed here: a stand-in module with its load/as_numpy."""
    import types

    calls = []
    fake = types.ModuleType("tensorflow_datasets")
    fake.load = lambda name, split, data_dir=None, shuffle_files=True: calls.append(
        (name, split, data_dir, shuffle_files)) or [
        {"text": r["text"].encode(), "id": r["id"]} for r in RECORDS]
    fake.as_numpy = lambda ds: ds
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
    spec = "tfds:wikipedia/20230601.en?split=train[:5]"
    m = prepare.prepare([spec], str(tmp_path / "out"), tok, _settings())
    assert calls == [("wikipedia/20230601.en", "train[:5]", None, False)]
    assert _rows(tmp_path / "out")[1] == _reference_rows(RECORD_DOCS, tok)
    assert m["source_identity"][0]["tfds"] == {"name": "wikipedia/20230601.en",
                                               "split": "train[:5]"}
    with pytest.raises(prepare.src.SourceError, match=r"row 0: no field 'body'"):
        prepare.prepare([spec], str(tmp_path / "bad"), tok, _settings(text_field="body"))


def _many_docs(n=60):
    """n documents of 1-3 lines; some repeat, within a block of the split and across workers."""
    docs = [[f"Document {i} says {'something ' * (i % 5)}here."] + [f"More of {i}."] * (i % 3)
            for i in range(n)]
    docs[3] = docs[2]       # same block
    docs[41] = docs[1]      # another worker's block
    docs[59] = docs[17]
    return docs


def test_two_workers_equal_one_byte_for_byte(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(prepare, "BLOCK", 4)   # 15 blocks over 60 documents, interleaved
    docs = _many_docs()
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in docs))
    one = prepare.prepare([str(tmp_path / "c.txt")], str(tmp_path / "one"), tok, _settings())
    first = prepare.prepare([str(tmp_path / "c.txt")], str(tmp_path / "two"), tok, _settings(),
                            shard=1, num_shards=2)
    assert first is None and not (tmp_path / "two").exists()   # waits for part 0
    two = prepare.prepare([str(tmp_path / "c.txt")], str(tmp_path / "two"), tok, _settings(),
                          shard=0, num_shards=2)
    recs1, rows1 = _rows(tmp_path / "one")
    recs2, _ = _rows(tmp_path / "two")
    assert recs1 == recs2 and len(recs1) > 2 * 7           # several shards
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    assert rows1 == _reference_rows(docs, tok)
    assert one["counts"]["duplicates_dropped"] == two["counts"]["duplicates_dropped"] == 3
    assert two["workers"] == 2 and not (tmp_path / "two.parts").exists()


def test_concurrent_workers_assemble_once(tmp_path, tok, teacher_dir):
    docs = _many_docs(2500)      # 3 blocks of 1,024: both workers tokenize
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in docs))
    args = ["--source", str(tmp_path / "c.txt"), "--out", str(tmp_path / "out"), "--tokenizer",
            str(teacher_dir), "--seq_len", str(SEQ), "--num_shards", "2"]
    env = dict(os.environ, JTB_PROGRESS="0",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-m", "jax_tinybert.data.prepare", *args,
                               "--shard", str(k)], env=env, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sum("rows of <=" in e for e in errs) == 1          # one of them assembled
    one = prepare.prepare([str(tmp_path / "c.txt")], str(tmp_path / "one"), tok,
                          prepare.Settings(seq_len=SEQ))
    assert _rows(tmp_path / "out")[0] == _rows(tmp_path / "one")[0]
    assert one["counts"]["duplicates_dropped"] == 3
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "one", "out"]


def test_a_run_reads_the_prepared_rows(tmp_path, tok, shared_dir, teacher_dir):
    from helpers import run_files
    from jax_tinybert.teacher.fingerprint import dataset_fingerprint
    from jax_tinybert.train import build

    books = [str(shared_dir / "data" / "corpus" / n) for n in
             ("gutenberg_pg1656_plato_apology_jowett.txt",
              "gutenberg_pg1974_aristotle_poetics_butcher.txt")]
    # build_packed_corpus keeps duplicates: so does this prepare, to compare the two.
    prepare.prepare(books, str(tmp_path / "prep"), tok,
                    prepare.Settings(seq_len=128, dedup=False, rows_per_shard=500))
    ref = corpus.build_packed_corpus(books, tok, 128, cache_dir=str(tmp_path / "cache"))
    c = run_files.config("general_distill.py", "small")
    c.data.corpus, c.train.batch_size = str(tmp_path / "prep"), 8
    d = build.build_data(c, str(tmp_path / "w"), teacher_dir)
    ds = d.train_dataset
    np.testing.assert_array_equal(ds.offsets, ref.offsets)
    np.testing.assert_array_equal(ds.input_ids, ref.input_ids)
    assert ds.input_ids.dtype == np.int32 and not ds.token_type_ids.any()
    assert dataset_fingerprint(ds) == dataset_fingerprint(ref)
    # Raw text is prepared into the run's cache first (duplicates dropped, as prepare's default).
    c.data.corpus = ",".join(books)
    d_raw = build.build_data(c, str(tmp_path / "w2"), teacher_dir)
    prepare.prepare(books, str(tmp_path / "dedup"), tok, prepare.Settings(seq_len=128))
    c.data.corpus = str(tmp_path / "dedup")
    d_ref = build.build_data(c, str(tmp_path / "w3"), teacher_dir)
    assert os.listdir(tmp_path / "w2" / "cache")[0].startswith("prepared-")
    b, b_ref = next(d_raw.train_batches), next(d_ref.train_batches)
    for k in b_ref:
        np.testing.assert_array_equal(b[k], b_ref[k])
    from jax_tinybert import data

    it = data.corpus_train_iterator(str(tmp_path / "dedup"), tok, global_batch_size=8,
                                    cache_dir=str(tmp_path / "unused"), seed=c.train.seed)
    np.testing.assert_array_equal(next(it)["input_ids"], b_ref["input_ids"])
    with pytest.raises(prepared.PreparedError, match="must be the only path"):
        corpus.packed_corpus([str(tmp_path / "prep"), books[0]], tok, cache_dir=str(tmp_path))


def _cli(argv, capsys):
    code = tool_exit(lambda: prepare.main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_bad_inputs_fail_in_one_line(tmp_path, tok, teacher_dir, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text('\n\n<doc id="1">\n</doc>\n   \n')
    base = ["--tokenizer", str(teacher_dir), "--out"]
    code, line = _cli(base + [str(tmp_path / "o1"), "--source", str(tmp_path / "empty")], capsys)
    assert code == 2 and line.startswith("error: no text in") and not (tmp_path / "o1").exists()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    code, line = _cli(base + [str(tmp_path / "o2"), "--source", str(tmp_path / "bad.jsonl")],
                      capsys)
    assert code == 2 and f"{tmp_path / 'bad.jsonl'}:2: no field 'text'" in line and "body" in line
    code, line = _cli(base + [str(tmp_path / "o3"), "--source", str(tmp_path / "nope")], capsys)
    assert code == 2 and "nope: no such file or folder" in line
    # Another tokenizer (cased): refused, naming both.
    other = tmp_path / "cased"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(os.path.join(teacher_dir, name), other / name)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(dict(cfg, do_lower_case=False)))
    (tmp_path / "t.txt").write_text("".join(f"Text {i}.\n\nMore text {i}.\n" for i in range(20)))
    out = tmp_path / "ok"
    prepare.prepare([str(tmp_path / "t.txt")], str(out), tok, _settings(rows_per_shard=2))
    with pytest.raises(prepared.PreparedError) as e:
        prepared.load_prepared(str(out), tokenize.load_data_tokenizer(str(other)))
    msg = one_line(e.value)
    fp_a = tokenize.tokenizer_fingerprint(tok)[:12]
    fp_b = tokenize.tokenizer_fingerprint(tokenize.load_data_tokenizer(str(other)))[:12]
    assert fp_a in msg and fp_b in msg and str(other) in msg and "\n" not in msg
    with pytest.raises(prepared.PreparedError, match="seq_len=32, the run has data.seq_len=128"):
        prepared.load_prepared(str(out), tok, 128)
    code, line = _cli(base + [str(out), "--source", str(tmp_path / "t.txt"), "--seq_len", "64"],
                      capsys)
    assert code == 2 and "holds a corpus prepared from other inputs (its settings differ" in line
    code = tool_exit(lambda: prepared.main([str(out)]))
    assert code == 0 and f"{out}: ok, 6 rows of <= 32 tokens" in capsys.readouterr().out
    # A damaged shard, then a missing one: named.
    shard = out / "rows-00001.array_record"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(prepared.PreparedError, match="shard rows-00001.array_record is damaged"):
        prepared.load_prepared(str(out), tok)
    code = tool_exit(lambda: prepared.main([str(out)]))
    line = capsys.readouterr().err.strip()
    assert code == 2 and line.startswith("error: ") and "rows-00001.array_record is damaged" in line
    shard.unlink()
    with pytest.raises(prepared.PreparedError, match="shard rows-00001.array_record is missing"):
        prepared.load_prepared(str(out), tok)


LIMITED = textwrap.dedent("""
    import os, resource, runpy, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    n = int(os.environ["FSIZE"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    sys.argv[0] = "prepare"
    runpy.run_module("jax_tinybert.data.prepare", run_name="__main__")
""")


def _run(args, fsize=None, env_extra=None, driver=None):
    """The CLI (or a driver script) in a subprocess; `fsize`: files limited to that many bytes
    (a full disk as the process sees it: writes fail with EFBIG)."""
    if fsize:
        driver, env_extra = LIMITED, dict(env_extra or {}, FSIZE=str(fsize))
    cmd = [sys.executable, "-c", driver, *args] if driver else \
        [sys.executable, "-m", "jax_tinybert.data.prepare", *args]
    env = dict(os.environ, JTB_PROGRESS="0", **(env_extra or {}),
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_full_disk_publishes_nothing_and_a_rerun_finishes(tmp_path, tok, teacher_dir):
    (tmp_path / "t.txt").write_text("".join(f"Paragraph {i} of some length and words.\n\n"
                                            for i in range(4000)))
    out = tmp_path / "out"
    args = ["--source", str(tmp_path / "t.txt"), "--out", str(out), "--tokenizer", str(teacher_dir),
            "--seq_len", str(SEQ)]
    r = _run(args, fsize=20_000)            # the worker's token stream does not fit
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: disk full while preparing") and "nothing was published" in line
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    # Two workers: part 1 fits, the rows assembled by worker 1 do not.
    r0 = _run(args + ["--shard", "0", "--num_shards", "2"])
    assert r0.returncode == 0 and not out.exists(), r0.stderr[-2000:]
    r1 = _run(args + ["--shard", "1", "--num_shards", "2"], fsize=120_000)
    line = r1.stderr.strip().splitlines()[-1]
    assert r1.returncode == 2 and "disk full" in line and "rows-00000.array_record" in line, line
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    m = prepare.prepare([str(tmp_path / "t.txt")], str(out), tok,
                        prepare.Settings(seq_len=SEQ), shard=1, num_shards=2)   # parts reused
    assert m["workers"] == 2 and prepared.read_rows(str(out)).offsets[-1] == m["tokens"]


KILL_DRIVER = textwrap.dedent("""
    import os, signal, sys
    from jax_tinybert.data import prepare
    prepare.BATCH_CHARS = 2000      # several batches, as in the test
    where, after = os.environ["KILL_IN"], int(os.environ["KILL_AFTER"])
    calls = [0]
    def killing(orig):
        def f(*a, **k):
            calls[0] += 1
            if calls[0] > after:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(*a, **k)
        return f
    if where == "tokenize":
        prepare.tokenize_documents = killing(prepare.tokenize_documents)
    else:
        prepare.RowWriter._write = killing(prepare.RowWriter._write)
    sys.exit(prepare.main(sys.argv[1:]))
""")


@pytest.mark.parametrize("where", ["tokenize", "rows"])
def test_killed_prepare_reruns_cleanly(tmp_path, tok, teacher_dir, monkeypatch, where):
    monkeypatch.setattr(prepare, "BATCH_CHARS", 2000)      # several batches
    docs = _many_docs(300)
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in docs))
    out = tmp_path / "out"
    args = ["--source", str(tmp_path / "c.txt"), "--out", str(out), "--tokenizer", str(teacher_dir),
            "--seq_len", str(SEQ), "--rows_per_shard", "7"]
    r = _run(args, driver=KILL_DRIVER, env_extra={
        "KILL_IN": where, "KILL_AFTER": "1" if where == "tokenize" else "20"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not out.exists() and [p for p in os.listdir(tmp_path) if ".tmp-" in p or
                                 p.endswith(".parts")]
    m = prepare.prepare([str(tmp_path / "c.txt")], str(out), tok, _settings())
    assert _rows(out)[1] == _reference_rows(docs, tok)
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "out"]     # nothing stale left
    assert m["counts"]["duplicates_dropped"] == 3


def test_finalize_assembles_finished_parts(tmp_path, tok, monkeypatch):
    docs = _many_docs(60)
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in docs))
    src, out = [str(tmp_path / "c.txt")], str(tmp_path / "out")
    monkeypatch.setattr(prepare, "BLOCK", 8)
    assert prepare.prepare(src, out, tok, _settings(), shard=0, num_shards=2) is None
    with pytest.raises(prepared.PreparedError, match=r"parts \[1\] of 2 are not done"):
        prepare.prepare(src, out, tok, _settings(), num_shards=2, finalize=True)
    with monkeypatch.context() as m:     # as if another worker held the lock and died
        m.setattr(prepare, "_take_lock", lambda parts_dir, force: force)
        assert prepare.prepare(src, out, tok, _settings(), shard=1, num_shards=2) is None
        done = prepare.prepare(src, out, tok, _settings(), num_shards=2, finalize=True)
    assert _rows(out)[1] == _reference_rows(docs, tok) and done["workers"] == 2


def test_the_benchmark_runs(tmp_path, tok):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import prepare_throughput as bench

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("\n\n".join("\n".join(d) for d in _many_docs(60)))
    res = bench.measure(str(tmp_path / "c"), tok, 1, SEQ)
    rows = {r["measure"]: r for r in bench.record_rows(res)}
    assert set(rows) == {"encode_batch", "encode_batch_fast", "prepare", "build_packed_corpus"}
    assert rows["prepare"]["prepare_speedup"] == 1.0 and res["pieces"] > 0


def test_parts_that_do_not_add_up_are_refused(tmp_path, tok, monkeypatch):
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in _many_docs(60)))
    src, out = [str(tmp_path / "c.txt")], str(tmp_path / "out")
    monkeypatch.setattr(prepare, "BLOCK", 8)
    prepare.prepare(src, out, tok, _settings(), shard=0, num_shards=2)
    monkeypatch.setattr(prepare, "BLOCK", 4)      # a worker that splits otherwise
    with pytest.raises(prepared.PreparedError, match="do not add up to one corpus"):
        prepare.prepare(src, out, tok, _settings(), shard=1, num_shards=2)
    assert not os.path.exists(out)


RACE = """
import sys
from jax_tinybert.data import corpus, tokenize
tok = tokenize.load_data_tokenizer(sys.argv[1])
rows = corpus.corpus_rows([sys.argv[2]], tok, 32, cache_dir=sys.argv[3])
print(len(rows), int(rows.lengths.sum()), int(rows.gather(list(range(len(rows))), 32)["input_ids"].sum()))
"""


def test_processes_sharing_a_cache_prepare_raw_text_once(tmp_path, teacher_dir):
    """Three processes of a run start on the same raw text and cache folder at once: one
    prepares it, the others wait for it, all read the same rows."""
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in _many_docs(30000)))
    env = dict(os.environ, JTB_PROGRESS="0",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(teacher_dir),
                               str(tmp_path / "c.txt"), str(tmp_path / "cache")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1, outs
    assert [n for n in os.listdir(tmp_path / "cache")] == [
        n for n in os.listdir(tmp_path / "cache") if n.startswith("prepared-")
        and "." not in n] and len(os.listdir(tmp_path / "cache")) == 1


def test_a_rerun_on_unchanged_raw_text_does_not_hash_it_again(tmp_path, tok, monkeypatch):
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in _many_docs(300)))
    first = corpus.corpus_rows([str(tmp_path / "c.txt")], tok, SEQ, cache_dir=str(tmp_path / "c"))
    hashed = []
    real = tokenize.file_fingerprint
    monkeypatch.setattr(tokenize, "file_fingerprint", lambda p: (hashed.append(p), real(p))[1])
    again = corpus.corpus_rows([str(tmp_path / "c.txt")], tok, SEQ, cache_dir=str(tmp_path / "c"))
    assert hashed == [] and len(again) == len(first)
    os.utime(tmp_path / "c.txt", (1, 1))                   # touched: hashed, the same corpus
    corpus.corpus_rows([str(tmp_path / "c.txt")], tok, SEQ, cache_dir=str(tmp_path / "c"))
    assert hashed == [str(tmp_path / "c.txt")] and len(os.listdir(tmp_path / "c")) == 1
