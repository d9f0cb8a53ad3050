"""A run's data: the train and dev sets of its task (GLUE, SQuAD, CoNLL, synthetic) or its
corpus, tokenized, with their length buckets and batchers (`build_data`)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional, Tuple

import jax
import numpy as np

from jax_tinybert import fs, speed
from jax_tinybert.config.check import ConfigValueError, owned_by_a_run
from jax_tinybert.data import batching, corpus, glue, position_tasks, reader, synthetic, tokenize


@dataclasses.dataclass
class Data:
    train_batches: Any             # BucketedBatcher over the train set (train mode)
    eval_batches: Optional[Any]    # BucketedBatcher over the dev set (eval mode) or None
    eval_labels: Optional[np.ndarray]
    task: Optional[str]
    num_labels: int
    id2label: Optional[dict]
    train_dataset: Any
    head: str = "sequence"         # sequence | span | token (model/heads.py)
    eval_split: Optional[position_tasks.Split] = None   # span / token: what the scorer reads
    max_len: int = 0


def subset(ds, n: int, seed: int):
    """n examples of an EncodedDataset drawn with a seeded shuffle, in dataset order (0 = all)."""
    return tokenize.take(ds, tokenize.subset_indices(len(ds), n, seed))


def build_data(config, workdir: str, tokenizer_dir: str) -> Data:
    """Tokenized train/dev sets and their batchers (GLUE TSV / HF / synthetic, or a corpus)."""
    dc = config.data
    cache_dir = dc.cache_dir or os.path.join(workdir, "cache")
    tok = tokenize.load_data_tokenizer(tokenizer_dir)
    gb = config.train.batch_size
    seed = config.train.seed
    if dc.kind == "corpus":
        if not dc.corpus:
            raise ConfigValueError("config.data.kind='corpus' needs config.data.corpus: text files "
                                   "or folders (e.g. data/corpus)")
        files = [p for p in str(dc.corpus).split(",") if p]
        # A folder of data.prepare is read as prepared; text is prepared into the cache first.
        ds = corpus.corpus_rows(files, tok, dc.seq_len, cache_dir=cache_dir, mode=dc.corpus_mode,
                                memory_tokens=dc.corpus_memory_tokens)
        idx = tokenize.subset_indices(len(ds), dc.train_subset, seed)
        if idx is not None:
            ds = (tokenize.take(ds, idx) if isinstance(ds, tokenize.EncodedDataset)
                  else reader.SubsetRows(ds, idx))
        batches = reader.CorpusBatcher(ds, gb, dc.seq_len, seed=seed,
                                       read_threads=dc.read_threads, prefetch=dc.prefetch,
                                       read_workers=dc.read_workers)
        return Data(batches, None, None, None, 1, None, ds)
    if position_tasks.get(dc.task):
        return _position_data(config, workdir, tokenizer_dir)
    spec = glue.get_task(dc.task)
    glue_dir = dc.glue_dir or os.environ.get("GLUE_DIR", "")
    if dc.kind == "synthetic":
        glue_dir = synthetic.write_sst2_like(os.path.join(cache_dir, "synthetic"),
                                             dc.synthetic_train, dc.synthetic_eval, seed=0)
    if dc.source == "tsv" and not glue_dir and not dc.train_file:
        raise ConfigValueError(
            f"no GLUE data for {spec.dir_name}: set GLUE_DIR or --config.data.glue_dir to a "
            f"folder holding {spec.dir_name}/train.tsv, or use --config.data.source=hf (online)")
    # The subset is chosen before tokenisation: a small run does not tokenize the whole split.
    load = lambda split, n, subset_seed, path=None: tokenize.load_glue_encoded(
        spec, split, tok, dc.max_len, glue_dir=glue_dir or None, path=path,
        cache_dir=cache_dir if dc.source == "tsv" else None, skip_bad_rows=dc.skip_bad_rows,
        source=dc.source, subset=n, subset_seed=subset_seed, store_dir=tokenize.token_store())
    train_ds = load("train", dc.train_subset, seed, dc.train_file or None)
    eval_ds = load(spec.eval_splits[0], dc.eval_subset, seed + 1)
    buckets, eval_buckets = choose_buckets(config, train_ds.lengths, eval_ds.lengths, workdir)
    batches = batching.BucketedBatcher(train_ds, gb, buckets, train=True, seed=seed)
    ev = batching.BucketedBatcher(eval_ds, config.train.eval_batch_size, eval_buckets,
                                  train=False)
    id2label = None if spec.labels is None else dict(enumerate(spec.labels))
    return Data(batches, ev, eval_ds.labels, spec.name, spec.num_labels, id2label, train_ds)


# A bucket's compilations are charged in train steps at this length (a compilation takes about
# as long at any length, while a step grows with it).
COMPILE_STEPS_LEN = 64
# A dev bucket's charge against a train bucket's, per row of padding: its only compilation is
# the eval program (~1/10 of a bucket's), and a dev row of padding costs a forward (~1/3 of a
# train row); MRPC's dev set then pads 13% less (benchmarks/RESULTS.md#length-buckets-and-compilation).
EVAL_BUCKET_SHARE = 0.3


BUCKETS_RECORD = "buckets.json"


def choose_buckets(config, train_lengths, eval_lengths,
                   workdir: Optional[str] = None) -> Tuple[tuple, tuple]:
    """(train buckets, eval buckets): config.data.buckets, or when () chosen from each set's
    lengths for this run, weighing a bucket's compilations (data.bucket_compile_steps, made
    concrete by speed.resolve) against
    the padding it saves over the run's passes (train: its epochs; dev: its evaluations).

    Chosen once per run: recorded in workdir/buckets.json and reused when the run resumes, so
    a resume that changes num_epochs keeps the data plan the checkpoint was saved under."""
    dc, tc = config.data, config.train
    if dc.buckets:
        b = batching.resolve_buckets(dc.buckets, dc.max_len)
        return b, b
    record = fs.join(workdir, BUCKETS_RECORD) if workdir else None
    owned = bool(workdir) and owned_by_a_run(workdir)
    if owned and fs.exists(record):
        with fs.open_file(record) as fh:
            saved = json.load(fh)
        if saved.get("num_train") == len(train_lengths) and saved.get("max_len") == dc.max_len:
            return tuple(saved["train"]), tuple(saved["eval"])
    n = max(1, len(train_lengths))
    epochs = (tc.num_steps * tc.batch_size / n) if tc.num_steps > 0 else tc.num_epochs
    evals = (math.ceil(epochs * n / tc.batch_size / tc.eval_every) if tc.eval_every
             else math.ceil(epochs))
    # A run started before buckets.json existed chose its buckets with compilations free.
    per_bucket = 0.0 if owned else float(  # auto resolved here too for a direct caller
        speed.resolve(config, speed.backend())[0].data.bucket_compile_steps)
    train = batching.resolve_buckets(
        (), dc.max_len, train_lengths, dc.max_buckets, passes=max(epochs, 1e-9),
        compile_cost=batching.compile_cost(per_bucket, tc.batch_size, COMPILE_STEPS_LEN))
    # A dev bucket compiles only the eval program, and its padding costs forwards, not train
    # steps: EVAL_BUCKET_SHARE of a train bucket's charge, in the train step's rows.
    dev = batching.resolve_buckets(
        (), dc.max_len, eval_lengths, dc.max_buckets, passes=max(evals, 1),
        compile_cost=EVAL_BUCKET_SHARE * batching.compile_cost(per_bucket, tc.batch_size,
                                                               COMPILE_STEPS_LEN))
    if record and jax.process_index() == 0:
        fs.makedirs(workdir)
        fs.write_json_atomic(record, {"train": list(train), "eval": list(dev),
                                      "num_train": len(train_lengths), "max_len": dc.max_len,
                                      "bucket_compile_steps": per_bucket, "epochs": epochs})
    return train, dev


def _position_data(config, workdir: str, tokenizer_dir: str) -> Data:
    """SQuAD / CoNLL train and dev rows (data/position_tasks.py) and their batchers."""
    dc, spec = config.data, position_tasks.get(config.data.task)
    tok = tokenize.load_tokenizer(tokenizer_dir)
    if spec.head == "token" and hasattr(tok, "add_prefix_space") and not tok.add_prefix_space:
        # byte-level BPE (RoBERTa): words given as split need a leading space each, as HF's
        # token-classification examples load it
        tok = type(tok).from_pretrained(tokenizer_dir, add_prefix_space=True)
    kw = dict(data_dir=dc.data_dir, source=dc.source, max_len=dc.max_len,
              doc_stride=dc.doc_stride, max_query_len=dc.max_query_len,
              ner_column=dc.ner_column)
    train = position_tasks.load(spec, "train", tok, subset=dc.train_subset,
                                subset_seed=config.train.seed, train_file=dc.train_file, **kw)
    dev = position_tasks.load(spec, "dev", tok, labels=train.labels, subset=dc.eval_subset,
                              subset_seed=config.train.seed + 1, **kw)
    buckets, eval_buckets = choose_buckets(config, train.encoded.lengths, dev.encoded.lengths,
                                           workdir)
    batches = batching.BucketedBatcher(train.encoded, config.train.batch_size, buckets,
                                       train=True, seed=config.train.seed)
    ev = batching.BucketedBatcher(dev.encoded, config.train.eval_batch_size, eval_buckets,
                                  train=False)
    num_labels = 2 if spec.head == "span" else len(train.labels)
    id2label = None if train.labels is None else dict(enumerate(train.labels))
    return Data(batches, ev, np.zeros(len(dev.encoded)), spec.name, num_labels, id2label,
                train.encoded, spec.head, dev, dc.max_len)
