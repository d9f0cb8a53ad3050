"""General-distillation batches through Grain: one global order, each process reads its own rows.

The order. Epoch e's permutation of the corpus rows is Grain's index shuffle
(`grain.MapDataset.shuffle`, seed + e): no permutation array, O(1) memory at any corpus size.
Global step t of an epoch holds positions [t*g, (t+1)*g) of that permutation (g = the global
batch; the positions past the last whole batch are dropped, other rows take them in the next
epoch's shuffle); process p of P reads positions [p*b, (p+1)*b) of each step, b = g / P. The rows
of a step thus depend on (seed, g, step) only, never on P or on device order: a run saved on 4
processes resumes on 2 with the same rows in every step.

Resume. The position is the number of global steps done. It is Grain's own iterator state
(`next_index` counts batches, i.e. global steps, the same on every process), saved in every
checkpoint as `state_dict()` (train/loop.py puts it in the checkpoint's metadata) and restored
on any process count with the same global batch.

Rows come from a row source with `__len__`, `gather(rows, T)` and `lengths`: a prepared folder's
ArrayRecord shards (`PreparedRows`, read in place: a process holds only the batches in flight) or
an in-memory / memmapped `EncodedDataset` (a small corpus, the official pregenerated files).
Reading is by batch (one ArrayRecord read per shard a batch touches: the reads run in C++), on
`read_threads` threads `prefetch` batches ahead of the step. The shards are read by
`PreparedRows` itself rather than Grain's ArrayRecordDataSource, which opens every shard up front
and asks for group_size:1 files (see prepared.RECORD_OPTIONS for why they hold 16 rows a chunk).

GLUE tasks keep `batching.BucketedBatcher`: the same contract (one global plan by (seed, epoch),
each process its rows, resume by (epoch, step)), but length-bucketed plans need the whole length
histogram of a set that fits in memory, which Grain's per-index shuffle does not give.
"""
from __future__ import annotations

import hashlib
import os
from typing import Dict, Iterator, Optional

import numpy as np

from jax_tinybert.data.batching import _process_defaults

# Rows of an epoch a host-side plan is built for at most (teacher-cache planning: small corpora
# only; a corpus-scale run keeps the teacher in the step and never asks).
MAX_PLAN_ROWS = 1 << 26


class PreparedRows:
    """The rows of a prepared folder read in place from its ArrayRecord shards.

    `gather(rows, T)` -> input_ids / attention_mask / token_type_ids int32 [b, T] (token types
    are all 0: the packed rows have one segment). `fingerprint`: the manifest's content key and
    shard digests (what a checkpoint records of its train data)."""

    def __init__(self, path: str, manifest: Dict):
        self.path, self.manifest = path, manifest
        self.files = [os.path.join(path, s["file"]) for s in manifest["shards"]]
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.num_rows = int(manifest["rows"])
        self.num_tokens = int(manifest["tokens"])
        self.seq_len = int(manifest["settings"]["seq_len"])
        self.pad_id = int(manifest["tokenizer"].get("pad_id") or 0)
        h = hashlib.sha256(manifest["key"].encode())
        for s in manifest["shards"]:
            h.update(s["sha256"].encode())
        self.fingerprint = h.hexdigest()[:24]
        self._starts = np.concatenate([[0], np.cumsum([int(s["rows"]) for s in
                                                        manifest["shards"]])]).astype(np.int64)
        self._readers, self._lock = None, None   # opened on first read, one per shard

    def __len__(self) -> int:
        return self.num_rows

    def __getstate__(self):   # Grain worker processes get the paths, not open readers
        return dict(self.__dict__, _readers=None, _lock=None)

    def _records(self, rows) -> list:
        """The records of global rows `rows`, one ArrayRecord read per shard touched."""
        if self._readers is None:
            import threading

            self._readers, self._lock = [None] * len(self.files), threading.Lock()
        rows = np.asarray(rows, np.int64)
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        # Where each shard's rows begin and end in the sorted rows.
        cut = np.searchsorted(srt, self._starts)
        out = [b""] * len(rows)
        for k in np.flatnonzero(cut[1:] > cut[:-1]).tolist():
            lo, hi = int(cut[k]), int(cut[k + 1])
            recs = self._reader(k).read((srt[lo:hi] - self._starts[k]).tolist())
            for i, r in zip(order[lo:hi].tolist(), recs):
                out[i] = r
        return out

    def _reader(self, k: int):
        if self._readers[k] is None:
            from array_record.python.array_record_module import ArrayRecordReader

            with self._lock:
                if self._readers[k] is None:
                    # No read-ahead: the reads are random.
                    self._readers[k] = ArrayRecordReader(self.files[k], "readahead_buffer_size:0")
        return self._readers[k]

    @property
    def lengths(self) -> np.ndarray:
        """int64 [rows] token counts, from the manifest: packing fills every row to seq_len
        but the last of the stream."""
        out = np.full(self.num_rows, self.seq_len, np.int64)
        if self.num_rows:
            out[-1] = self.num_tokens - (self.num_rows - 1) * self.seq_len
        return out

    def gather(self, rows: np.ndarray, seq_len: int) -> Dict[str, np.ndarray]:
        recs = self._records(rows)
        n = np.fromiter((len(r) for r in recs), np.int64, len(recs)) // self.dtype.itemsize
        if len(n) and int(n.max()) > seq_len:
            raise ValueError(f"{self.path}: a row has {int(n.max())} tokens > {seq_len}")
        mask = np.arange(seq_len)[None, :] < n[:, None]
        ids = np.full((len(recs), seq_len), self.pad_id, np.int32)
        ids[mask] = np.frombuffer(b"".join(recs), self.dtype)   # row-major: row by row
        return {"input_ids": ids, "attention_mask": mask.astype(np.int32),
                "token_type_ids": np.zeros_like(ids)}


def _grain():
    import grain

    return grain


def _process_steps_class():
    """grain.MapDataset of process p's row indices, one item per global step: item t holds
    positions [p*b, (p+1)*b) of step t (module docstring), int64 [b]. Made on first use (grain
    is imported only by corpus runs) and bound at module level, so that Grain's worker
    processes can unpickle it."""
    cls = globals().get("_ProcessSteps")
    if cls is not None:
        return cls
    grain = _grain()

    class _ProcessSteps(grain.MapDataset):
        def __init__(self, order, n: int, g: int, b: int, p: int, steps: int, epochs: int):
            super().__init__(order)
            self._shape = (n, g, b, p, steps, epochs)

        def __len__(self) -> int:
            return self._shape[4] * self._shape[5]

        def __str__(self) -> str:
            n, g, b, p, _, _ = self._shape
            return f"ProcessSteps(process={p}, rows_per_step={b}, global_batch={g}, rows={n})"

        def __getitem__(self, t):
            if isinstance(t, slice):
                return self.slice(t)
            n, g, b, p, steps, _ = self._shape
            e, s = divmod(int(t), steps)
            start = e * n + s * g + p * b
            return np.asarray(self._parent._getitems(list(range(start, start + b))), np.int64)

    globals()["_ProcessSteps"] = _ProcessSteps
    return _ProcessSteps


class _ReadBatch:
    """Grain map: a batch of row indices -> the batch dict (rows read in one call)."""

    def __init__(self, source, seq_len: int):
        self.source, self.seq_len = source, int(seq_len)

    def __call__(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
        rows = np.asarray(rows, np.int64)
        batch = self.source.gather(rows, self.seq_len)
        batch.pop("labels", None)
        batch["example_id"] = rows
        batch["valid"] = np.ones(len(rows), np.float32)
        return batch


class _EpochPlan:
    """`batching._Plan`'s fields for one epoch of a CorpusBatcher; rows built on first use."""

    def __init__(self, batcher: "CorpusBatcher", epoch: int):
        self.seq_lens = np.full(batcher.steps_per_epoch, batcher.buckets[0], np.int32)
        self._batcher, self._epoch, self._rows = batcher, epoch, None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            b = self._batcher
            n = b.steps_per_epoch * b.global_batch_size
            if n > MAX_PLAN_ROWS:
                raise ValueError(f"epoch_plan: {n:,} rows per epoch is a corpus-scale run; its "
                                 "batches are read step by step")
            self._rows = b.positions_rows(self._epoch, 0, n).reshape(b.steps_per_epoch, -1)
        return self._rows


class SubsetRows:
    """Rows `index` (int64 [m]) of a row source, as a row source (data.train_subset)."""

    def __init__(self, source, index: np.ndarray):
        self.source, self.index = source, np.asarray(index, np.int64)
        fp = getattr(source, "fingerprint", None)
        self.fingerprint = None if fp is None else hashlib.sha256(
            fp.encode() + self.index.tobytes()).hexdigest()[:24]

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.source.lengths)[self.index]

    def gather(self, rows: np.ndarray, seq_len: int) -> Dict[str, np.ndarray]:
        return self.source.gather(self.index[np.asarray(rows, np.int64)], seq_len)


class CorpusBatcher:
    """Per-process batches of a corpus (module docstring): the `BucketedBatcher` interface with
    one bucket, seq_len.

    Args:
      source: rows (`PreparedRows`, an `EncodedDataset`); global_batch_size: g, divisible by
        the process count; num_epochs: None = forever; read_threads, prefetch: Grain's
        ReadOptions (threads reading batches, batches read ahead); read_workers: Grain worker
      processes (0: threads of this process only).
    Yields input_ids / attention_mask / token_type_ids int32 [b, seq_len], example_id int64 [b]
    (the corpus row), valid float32 [b] (all 1).
    """

    def __init__(self, source, global_batch_size: int, seq_len: int = 128, *, seed: int = 0,
                 num_epochs: Optional[int] = None, process_index: Optional[int] = None,
                 process_count: Optional[int] = None, read_threads: int = 2, prefetch: int = 8,
                 read_workers: int = 0):
        self.dataset = source
        self.global_batch_size = int(global_batch_size)
        self.buckets = (int(seq_len),)
        self.seed = int(seed)
        self.num_epochs = num_epochs
        self.process_index, self.process_count = _process_defaults(process_index, process_count)
        if self.global_batch_size % self.process_count:
            raise ValueError(f"global batch {self.global_batch_size} not divisible by "
                             f"{self.process_count} processes")
        self.local_batch_size = self.global_batch_size // self.process_count
        self.read_threads, self.prefetch = int(read_threads), int(prefetch)
        self.read_workers = int(read_workers)
        self.num_rows = len(source)
        self.steps_per_epoch = self.num_rows // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"a corpus of {self.num_rows} rows gives no full batch of "
                             f"{self.global_batch_size}; use a smaller batch or more text")
        self._done = 0          # global steps taken
        self._it = None
        self._plan_epoch, self._plan = None, None

    # -- the order --------------------------------------------------------------------------
    def _order(self):
        return _grain().MapDataset.range(self.num_rows).shuffle(seed=self.seed % 2**32)

    def positions_rows(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Rows at positions [start, stop) of epoch `epoch`'s permutation (int64)."""
        n = self.num_rows
        return np.asarray(self._order()._getitems(list(range(epoch * n + start, epoch * n + stop))),
                          np.int64)

    def global_rows(self, step: int) -> np.ndarray:
        """int64 [g] the rows of global step `step` (counted from the run's start), process 0's
        first."""
        e, s = divmod(int(step), self.steps_per_epoch)
        g = self.global_batch_size
        return self.positions_rows(e, s * g, (s + 1) * g)

    def epoch_plan(self, epoch: int) -> "_EpochPlan":
        """One epoch's `seq_lens` [steps] and, computed when first read, `rows` [steps, g]: for
        planning a teacher cache over a small corpus (refused above MAX_PLAN_ROWS rows)."""
        if self._plan_epoch != epoch:
            self._plan_epoch, self._plan = epoch, _EpochPlan(self, epoch)
        return self._plan

    def rows_read(self, num_steps: int) -> np.ndarray:
        """Sorted distinct rows (int64) that global steps [0, num_steps) read."""
        spe, g = self.steps_per_epoch, self.global_batch_size
        seen = np.zeros(self.num_rows, bool)
        for e in range(-(-int(num_steps) // spe)):
            seen[self.epoch_plan(e).rows[:int(num_steps) - e * spe].ravel()] = True
            if seen.all():
                break
        return np.flatnonzero(seen).astype(np.int64)

    def batch_at(self, epoch: int, step: int) -> Dict[str, np.ndarray]:
        """This process's batch of global step `step` of epoch `epoch`."""
        rows = self.global_rows(epoch * self.steps_per_epoch + step)
        b, p = self.local_batch_size, self.process_index
        return _ReadBatch(self.dataset, self.buckets[0])(rows[p * b:(p + 1) * b])

    # -- iteration --------------------------------------------------------------------------
    def _pipeline(self):
        """Grain's iterator from the step after the `_done` ones taken."""
        grain = _grain()
        epochs = self.num_epochs if self.num_epochs is not None else 1 << 30
        steps = _process_steps_class()(self._order(), self.num_rows, self.global_batch_size,
                                       self.local_batch_size, self.process_index,
                                       self.steps_per_epoch, int(epochs))
        ds = steps.map(_ReadBatch(self.dataset, self.buckets[0]))
        opts = grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=self.prefetch)
        if not self.read_workers:
            it = iter(ds.to_iter_dataset(opts))
            it.set_state({"next_index": self._done})
            return it
        from absl import flags

        if not flags.FLAGS.is_parsed():   # Grain's workers read its absl flags (a library call)
            flags.FLAGS.mark_as_parsed()
        # Worker processes each take every k-th item: start from a slice rather than a state,
        # so that a resume needs no per-worker state.
        return iter(ds[self._done:].to_iter_dataset(opts).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=self.read_workers)))

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        if self.num_epochs is not None and self._done >= self.num_epochs * self.steps_per_epoch:
            raise StopIteration
        if self._it is None:
            self._it = self._pipeline()
        batch = next(self._it)
        self._done += 1
        return batch

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("infinite iterator (num_epochs=None) has no len()")
        return self.steps_per_epoch * self.num_epochs

    @property
    def epoch(self) -> int:
        return self._done // self.steps_per_epoch

    @property
    def step(self) -> int:
        return self._done % self.steps_per_epoch

    def reset(self) -> None:
        """Back to the first step."""
        self._close()
        self._done = 0

    def _close(self) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None

    def state_dict(self) -> Dict:
        """Position to resume from (the next batch is step `step` of epoch `epoch`), with Grain's
        iterator state and what the order depends on."""
        # Grain's state of the in-process iterator (a worker pool's covers its slice only).
        grain_state = (self._it.get_state() if self._it is not None and not self.read_workers
                       else {"next_index": self._done})
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "num_examples": self.num_rows, "global_batch_size": self.global_batch_size,
                "steps_per_epoch": self.steps_per_epoch, "buckets": list(self.buckets),
                "reader": "grain", "grain": dict(grain_state)}

    def load_state_dict(self, state: Dict) -> None:
        """Restores a `state_dict()` saved on any number of processes."""
        for k, mine in (("seed", self.seed), ("num_examples", self.num_rows),
                        ("global_batch_size", self.global_batch_size)):
            if k in state and int(state[k]) != mine:
                raise ValueError(f"cannot resume: saved {k}={state[k]} but this run has {mine} "
                                 "(the corpus or the batch changed)")
        done = int(state["epoch"]) * self.steps_per_epoch + int(state["step"])
        saved = (state.get("grain") or {}).get("next_index")
        if saved is not None and int(saved) != done:
            raise ValueError(f"cannot resume: the saved reader state ({saved} steps) disagrees "
                             f"with epoch {state['epoch']} step {state['step']}")
        self._close()
        self._done = done
