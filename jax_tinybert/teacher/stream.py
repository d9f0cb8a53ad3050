"""A training run's teacher cache built beside its steps (`teacher.cache_build='beside'`).

Built before the first step, the per-token cache of the intermediate stage is a 24-34 s teacher
pass (MRPC, 2 CPU cores) followed by steps that keep only ~1.8 of the two cores busy (XLA runs
each attention product on one core). Built in a thread while the steps run, the pass fills that
idle core. The pass then forwards the rows in the order the steps read them
(`steps_order`), and a step whose rows are not written yet waits for them
(`StreamingCache.lookup`). What the cache holds, its fingerprint and its files are those of a
build before the steps (teacher_cache.build); only the order of the rows in the files differs.
A prediction stage's cache of teacher logits is built so too where its pass is not packed
(`teacher_cache.follows_steps`; MRPC without a teacher store entry: 2.3 s of a 68 s epoch).

    order = steps_order(batcher, num_steps)        # before the steps take a batch
    cache = StreamingCache(lambda live: teacher_cache.build_for_training(..., live=live,
                                                                         order=order), dtype)
    batch.update(cache.lookup(batch["example_id"], seq_len=T))   # waits for its rows
    cache = cache.result()                                      # the finished TeacherCache

`TokenCacheDrop` deletes a finished run's per-token cache in a thread beside the export.
"""
from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import jax
import numpy as np

from jax_tinybert import fs
from jax_tinybert.teacher import cache as tc
from jax_tinybert.teacher import training as tt


class BuildStopped(Exception):
    """Raised inside the build thread when the run stops it (`StreamingCache.stop`)."""


class _GrowingFile:
    """Slices of a raw file that is still being appended to, as `np.memmap` gives them: mapped
    again when a slice reaches past the last mapping. Mapped through an open descriptor, so the
    rename of the finished folder does not break it."""

    def __init__(self, path: str, dtype):
        self.dtype = np.dtype(dtype)
        self._fh = open(path, "rb")
        self._map: np.ndarray = np.zeros((0,), self.dtype)

    def __getitem__(self, s: slice) -> np.ndarray:
        if s.stop > len(self._map):
            size = os.fstat(self._fh.fileno()).st_size // self.dtype.itemsize
            self._map = np.memmap(self._fh, dtype=self.dtype, mode="r", shape=(size,))
        return self._map[s]

    def close(self) -> None:
        self._map = np.zeros((0,), self.dtype)
        self._fh.close()


class Live:
    """What a build shares with the steps reading it: its rows so far, and a stop flag.

    teacher_cache.build calls `attach` once its files are open, `fill` after each batch of rows
    is on disk and `check` between batches."""

    def __init__(self, token_dtype: Optional[str] = None):
        self.cond = threading.Condition()
        self.token_dtype = token_dtype
        self.stop = False
        self.parts: Optional[Dict[str, Any]] = None
        self._files: Dict[str, _GrowingFile] = {}

    def attach(self, folder: str, num_examples: int, fields: Dict[str, np.ndarray],
               filled: np.ndarray, tokens) -> None:
        """folder: where the build writes; fields: its `.npy` memmaps by name (filled in as the
        first rows come); filled: bool [num_examples]; tokens: its `_TokenWriter`."""
        with self.cond:
            self.parts = dict(folder=folder, num_examples=num_examples, fields=fields,
                              filled=filled, tokens=tokens)
            # Opened now, while `folder` has its temporary name: a first lookup after the
            # build's rename (a short pass, done before the first step) finds them open.
            for k in tokens.names:
                self._files[k] = _GrowingFile(os.path.join(folder, k + ".bin"), tokens.dtype)

    def fill(self, filled: np.ndarray, ids: np.ndarray) -> None:
        """Marks rows `ids` written (their bytes flushed to the files) and wakes the readers."""
        with self.cond:
            filled[ids] = True
            self.cond.notify_all()

    def check(self) -> None:
        if self.stop:
            raise BuildStopped("the teacher cache build was stopped")

    def view(self) -> tc.TeacherCache:
        """The rows written so far as a `TeacherCache` (lookups of unwritten rows fail)."""
        p, tok = self.parts, self.parts["tokens"]
        return tc.TeacherCache.building(
            p["folder"], p["num_examples"], tt._step_fields(dict(p["fields"]), self.token_dtype),
            p["filled"], dict(self._files), tok.index if tok.names else None, tok.row_shapes)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self.parts = None   # the build's maps, read until it was done


class StreamingCache:
    """A teacher cache whose build (`make(live)` -> TeacherCache) runs in a thread; `lookup`
    is `TeacherCache.lookup`, waiting for rows not written yet. An error of the build is
    raised by the lookup that waits, or by `result`."""

    def __init__(self, make: Callable[[Live], tc.TeacherCache], token_dtype: Optional[str]):
        self.live = Live(token_dtype)
        self._final: Optional[tc.TeacherCache] = None
        self._error: Optional[BaseException] = None
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(make,), daemon=True,
                                        name="teacher-cache")
        self._thread.start()

    def _run(self, make) -> None:
        try:
            final = make(self.live)
        except BaseException as e:   # handed to the steps' thread
            final, err = None, e
        else:
            err = None
        with self.live.cond:
            self._final, self._error, self._done = final, err, True
            self.live.cond.notify_all()

    def lookup(self, example_ids, seq_len: Optional[int] = None) -> Dict[str, np.ndarray]:
        """`TeacherCache.lookup`, once the rows of `example_ids` are written."""
        ids = np.asarray(example_ids, np.int64).reshape(-1)
        with self.live.cond:
            while True:
                if self._error is not None:
                    raise self._error
                if self._done:
                    break
                p = self.live.parts
                if p is not None:
                    need = ids[(ids >= 0) & (ids < p["num_examples"])]
                    if p["filled"][need].all():
                        break
                # A timeout keeps the main thread answering signals (Ctrl-C) while it waits.
                self.live.cond.wait(0.5)
            view = None if self._done else self.live.view()
        if view is None:
            return self._final.lookup(ids, seq_len=seq_len)
        return view.lookup(ids, seq_len=seq_len)

    def result(self) -> tc.TeacherCache:
        """The finished cache (waits for the build; raises its error)."""
        self._thread.join()
        self.live.close()
        if self._error is not None:
            raise self._error
        return self._final

    def stop(self) -> None:
        """Stops the build (its temporary folder is removed) and waits for the thread."""
        self.live.stop = True
        self._thread.join()
        self.live.close()


def steps_order(batcher, num_steps: int) -> Iterator[Tuple[int, np.ndarray]]:
    """(T, example rows int64 [global batch], -1 = filler) of the steps a run takes next, in
    their order: from the batcher's position (`epoch`, `step`) to the end of that epoch or to
    global step `num_steps`. One epoch at most: the rows the next one reads again are cached
    by then, and the few it reads for the first time (each bucket's incomplete batch of this
    epoch) are better forwarded in full chunks than a few to a step.

    Read now, not when iterated: the build thread iterates it while the steps move the batcher
    on (and the batcher's plan cache is not shared between threads)."""
    spe = batcher.steps_per_epoch
    epoch, pos = int(batcher.epoch), int(batcher.step)
    if pos >= spe:
        epoch, pos = epoch + 1, 0
    end = max(pos, min(spe, int(num_steps) - epoch * spe))
    plan = batcher.epoch_plan(epoch)
    lens, rows = plan.seq_lens[pos:end].copy(), plan.rows[pos:end].copy()
    return iter([(int(t), r) for t, r in zip(lens, rows)])


class TokenCacheDrop:
    """Deletes a finished run's per-token teacher cache (GBs that only a resumed, unfinished
    run reads again; the small logits / [CLS] caches stay) in a thread: freeing the pages of
    MRPC's 2.45 GB took the main thread ~0.5 s after the last step. `finish()` waits and says
    so; `wait()` only waits (a run that fails after its last step)."""

    def __init__(self, cache):
        self._thread, self._error, self._note = None, None, None
        if cache is None or not cache.token_fields:
            return
        gb = sum(i["bytes"] for i in cache.meta["token_fields"].values()) / 1e9
        self._note = (f"[teacher cache] removed the per-token cache {cache.path} ({gb:.2f} "
                      "GB): the run is finished")
        self._thread = threading.Thread(target=self._run, args=(cache,), daemon=True,
                                        name="teacher-cache-drop")
        self._thread.start()

    def _run(self, cache) -> None:
        try:
            # A cache all the processes read (teacher/split.py) is removed by process 0 alone.
            if not cache.shared or jax.process_index() == 0:
                fs.rmtree(cache.path)
            if cache.local_dir != cache.path:
                shutil.rmtree(cache.local_dir, ignore_errors=True)
            cache.close()   # the last maps of the deleted files: their pages are freed here
        except BaseException as e:   # raised by finish(), in the run's thread
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def finish(self) -> None:
        self.wait()
        if self._error is not None:
            raise self._error
        if self._note and jax.process_index() == 0:
            print(self._note, flush=True)
