"""Host-side data: GLUE tasks, tokenization, bucketed per-process batches, corpus, augmentation.

Entry points for the training loop (batches as in docs/design.md, "Batches"):

    train_it = data.glue_train_iterator("sst-2", glue_dir, tokenizer_dir, global_batch_size=32,
                                        max_len=64, seed=0, cache_dir=workdir + "/data_cache")
    evals = data.glue_eval_iterators("mnli", glue_dir, tokenizer_dir, global_batch_size=64)
    # -> {"dev_matched": it, "dev_mismatched": it}; each a one-pass iterator, `.reset()` to rerun
    corpus_it = data.corpus_train_iterator(corpus_dir, tokenizer_dir, global_batch_size=256,
                                           seq_len=128, cache_dir=...)
    state = train_it.state_dict(); train_it.load_state_dict(state)   # exact resume
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from jax_tinybert.data.batching import (DEFAULT_BUCKETS, BucketedBatcher, assign_buckets,
                                        padding_waste)
from jax_tinybert.data.glue import (TASKS, DataError, Example, TaskSpec, get_task, load_examples,
                                    tsv_path)
from jax_tinybert.data import corpus as _corpus
from jax_tinybert.data.reader import CorpusBatcher
from jax_tinybert.data.tokenize import EncodedDataset, load_glue_encoded, load_tokenizer

__all__ = [
    "DEFAULT_BUCKETS", "BucketedBatcher", "CorpusBatcher", "DataError", "EncodedDataset", "Example", "TASKS",
    "TaskSpec", "assign_buckets", "corpus_train_iterator", "get_task", "glue_eval_iterators",
    "glue_train_iterator", "load_examples", "load_glue_encoded", "load_tokenizer",
    "padding_waste", "pregenerated_train_iterator", "tsv_path", "buckets_for",
]


def buckets_for(max_len: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple:
    """The configured buckets below max_len, plus max_len itself (the longest possible)."""
    return tuple(sorted({int(b) for b in buckets if b < max_len} | {int(max_len)}))


def _tok(tokenizer):
    return load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer


def glue_train_iterator(task, glue_dir: Optional[str], tokenizer, *, global_batch_size: int = 32,
                        max_len: int = 128, buckets: Sequence[int] = DEFAULT_BUCKETS,
                        seed: int = 0, num_epochs: Optional[int] = None,
                        train_file: Optional[str] = None, cache_dir: Optional[str] = None,
                        drop_remainder: bool = True, skip_bad_rows: bool = False,
                        process_index: Optional[int] = None,
                        process_count: Optional[int] = None) -> BucketedBatcher:
    """Shuffled, bucketed training batches of a GLUE task (per process).

    `train_file`: e.g. an augmented `train_aug.tsv` instead of <glue_dir>/<Task>/train.tsv.
    `tokenizer`: a fast HF tokenizer or its folder/hub name.
    """
    ds = load_glue_encoded(task, "train", _tok(tokenizer), max_len, glue_dir=glue_dir,
                           path=train_file, cache_dir=cache_dir, skip_bad_rows=skip_bad_rows)
    return BucketedBatcher(ds, global_batch_size, buckets_for(max_len, buckets), train=True,
                           seed=seed, drop_remainder=drop_remainder, num_epochs=num_epochs,
                           process_index=process_index, process_count=process_count)


def glue_eval_iterators(task, glue_dir: str, tokenizer, *, global_batch_size: int = 32,
                        max_len: int = 128, buckets: Sequence[int] = DEFAULT_BUCKETS,
                        cache_dir: Optional[str] = None, splits: Optional[Sequence[str]] = None,
                        process_index: Optional[int] = None,
                        process_count: Optional[int] = None) -> Dict[str, BucketedBatcher]:
    """{split: one-pass eval iterator}; dev splits of the task by default (MNLI: dev_matched and
    dev_mismatched). No shuffle, nothing dropped: incomplete batches carry `valid` = 0 rows."""
    spec = get_task(task)
    tok = _tok(tokenizer)
    out = {}
    for split in (splits or spec.eval_splits):
        ds = load_glue_encoded(spec, split, tok, max_len, glue_dir=glue_dir, cache_dir=cache_dir)
        out[split] = BucketedBatcher(ds, global_batch_size, buckets_for(max_len, buckets),
                                     train=False, process_index=process_index,
                                     process_count=process_count)
    return out


def corpus_train_iterator(corpus, tokenizer, *, global_batch_size: int = 256, seq_len: int = 128,
                          cache_dir: str, mode: str = "sentences", seed: int = 0,
                          num_epochs: Optional[int] = None, process_index: Optional[int] = None,
                          process_count: Optional[int] = None,
                          memory_tokens: int = 1 << 25) -> CorpusBatcher:
    """General-distillation batches of a corpus, as a run reads them (`reader.CorpusBatcher`):
    a folder written by `python -m jax_tinybert.data.prepare` (local or gs://), or text files
    and folders, prepared into cache_dir first. Shuffled by (seed, epoch) through Grain, each
    process its rows of every global batch, resumable on any process count."""
    rows = _corpus.corpus_rows(corpus, _tok(tokenizer), seq_len, cache_dir=cache_dir, mode=mode,
                               memory_tokens=memory_tokens)
    return CorpusBatcher(rows, global_batch_size, seq_len, seed=seed, num_epochs=num_epochs,
                         process_index=process_index, process_count=process_count)


def pregenerated_train_iterator(path: str, tokenizer, *, epoch: int = 0,
                                global_batch_size: int = 256, seq_len: int = 128,
                                cache_dir: Optional[str] = None, seed: int = 0,
                                process_index: Optional[int] = None,
                                process_count: Optional[int] = None) -> CorpusBatcher:
    """One epoch over the official TinyBERT `epoch_{epoch % n}.json`, through the corpus reader
    (rows padded to seq_len, as the official loader does). Create one per training epoch (the
    data differ per epoch); the shuffle uses (seed, epoch)."""
    ds = _corpus.read_pregenerated(path, _tok(tokenizer), epoch=epoch, max_seq_len=seq_len,
                                   cache_dir=cache_dir)
    it = CorpusBatcher(ds, global_batch_size, seq_len, seed=seed, num_epochs=epoch + 1,
                       process_index=process_index, process_count=process_count)
    it.load_state_dict({"epoch": epoch, "step": 0})
    return it
