"""Checkpoints: orbax-checkpoint 0.12 `CheckpointManager` behind one small class.

Layout under `workdir`::

    workdir/checkpoints/<step>/{state,meta}/   the last `max_to_keep` periodic saves
    workdir/checkpoints/<step>/digests.json    a digest of every file of the step (SHA-256;
                                              on gs:// the store's CRC32C)
    workdir/checkpoints/corrupt_<step>/        a save found damaged or unreadable, moved aside
    workdir/best/<step>/{state,meta,metrics}/  the best save by a dev metric (kept apart, so
                                              pruning of the periodic saves never touches it)
    workdir/best/corrupt_<step>/               a damaged best save, moved aside

Each save holds `state` (a pytree of jax arrays, e.g. `TrainState`; arrays may be sharded
`NamedSharding` arrays spread over several processes) and `meta` (a JSON dict: data iterator
position, config fingerprint, metrics...).

Use from the training loop (every process runs the same calls; orbax decides who writes)::

    ckpt = Checkpointer(workdir, max_to_keep=3, save_interval_steps=1000,
                        best_metric="accuracy", best_mode="max")
    restored = ckpt.restore_latest(abstract_state)  # None on a fresh run
    if restored is not None:
        step, state, meta = restored
    for step in ...:
        state, metrics = train_step(state, batch)
        ckpt.maybe_save(step, state, meta)       # async; only every save_interval_steps
        if eval_now:
            ckpt.save_best(step, state, meta, dev_accuracy)  # kept only if better
        if preemption.poll(step, metrics["loss"]):   # jax_tinybert/train/preemption.py
            ckpt.save(step, state, meta, force=True)
            ckpt.close()                         # waits for the async write
            raise Preempted(step)
    ckpt.save(last_step, state, meta, force=True)
    ckpt.close()

`abstract_state` is a pytree shaped like the state whose leaves are
`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (concrete arrays are accepted too; their
shape/dtype/sharding are used). The sharding given is the one the arrays are restored onto,
so a state saved on 8 devices restores onto 1 device or onto another mesh.

Returned values: `restore_latest` / `restore_best` -> `(step, state, meta)` or `None` when
there is no (intact) checkpoint. Every file of a step is checked against the digests written
when it was saved (digests.py), by process 0 (the others check that each file is there with
its size on a local disk), before orbax reads it; the verdicts are OR-ed over processes:
a damaged step (even one that would decode) or one orbax cannot read is skipped by all
processes with a `logging.warning` naming it and moved to `corrupt_<step>`; if no checkpoint
can be read and some failure was orbax's own, nothing readable is moved and the newest error
is raised (a state that no longer matches the saved one, e.g. after a config change, fails
that way instead of silently discarding good checkpoints).

See docs/checkpoints.md for resume, damage detection, preemption and mesh changes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jax_tinybert.train import digests
from jax_tinybert.train.orbax_quiet import quiet_orbax_failures
from jax_tinybert import fs
from jax_tinybert.parallel.coordination import Coordinator
from jax_tinybert.errors import UserError, is_disk_full

log = logging.getLogger(__name__)


__all__ = ["Checkpointer", "abstract_like", "DiskFull", "state_bytes", "check_free_space"]

# Key in each saved meta: this step has a digests.json (so one that lacks it is damaged, not
# merely written by a version without digests).
_DIGESTED = "_digested"



class DiskFull(UserError, OSError):
    """A checkpoint could not be written: the workdir's disk is full."""


def _free_bytes(path) -> int | None:
    """Free bytes on the local disk holding `path`; None for a bucket."""
    return None if fs.is_remote(os.fspath(path)) else fs.free_bytes(path)


def _mb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


# Room wanted beyond a checkpoint's arrays: its metadata, digests and the file system's blocks.
_SLACK = 16 << 20


def state_bytes(state) -> int:
    """Bytes of a pytree's arrays (or ShapeDtypeStructs), all shards together: what a
    checkpoint of `state` writes uncompressed."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(state) if hasattr(x, "shape")))


def check_free_space(workdir: str, state, max_to_keep: int, keep_best: bool) -> None:
    """Before training: refuses a local workdir whose disk cannot hold one checkpoint of
    `state`, and warns when it cannot hold the run's `max_to_keep` (+ the best) of them."""
    free = _free_bytes(workdir)
    if free is None:
        return
    one = state_bytes(state) + _SLACK
    keep = max(1, int(max_to_keep or 1)) + (1 if keep_best else 0)
    if free < one:
        raise DiskFull(
            f"the disk of workdir {workdir} has {_mb(free)} free, and one checkpoint of this run "
            f"takes ~{_mb(one)} (the student's params and optimizer state); free space there or "
            "use a --workdir on a larger disk")
    if free < one * (keep + 1):
        log.warning("the disk of workdir %s has %s free; this run keeps up to %d checkpoints of "
                    "~%s (train.max_to_keep=%s%s) and writes the next beside them: it may run out "
                    "of space (then it stops, and the same command resumes)", workdir, _mb(free),
                    keep, _mb(one), max_to_keep, " + the best" if keep_best else "")


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    raise TypeError(f"meta value of type {type(x).__name__} is not JSON serialisable: {x!r}")


def _to_json(meta: Mapping[str, Any] | None) -> dict:
    # Round trip now so a bad value fails in the caller's thread, not in orbax's writer.
    return json.loads(json.dumps(dict(meta or {}), default=_json_default))


def abstract_like(tree, sharding=None):
    """Pytree of `jax.ShapeDtypeStruct` for `tree` (arrays or ShapeDtypeStructs).

    `sharding`: None keeps each leaf's own sharding (a leaf without one gets the first local
    device); a `jax.sharding.Sharding` applies to every leaf; a pytree of shardings matching
    `tree` gives one per leaf.
    """
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def one(x, s=None):
        s = s if s is not None else getattr(x, "sharding", None)
        if s is None:
            s = default
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)

    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, sharding), tree)
    return jax.tree.map(one, tree, sharding)


class Checkpointer:
    """Periodic + best checkpoints of `(state, meta)`, verified at restore, with fallback.

    Args:
      workdir: run directory; checkpoints go to `workdir/checkpoints`, the best to `workdir/best`.
      max_to_keep: periodic checkpoints kept (oldest pruned first). None keeps all.
      save_interval_steps: `maybe_save` writes when `step % save_interval_steps == 0`.
      keep_best: keep the best checkpoint by `save_best`'s metric in `workdir/best`.
      best_metric: the metric's name (stored with the best checkpoint; informational).
      best_mode: "max" or "min".
      async_save: write in a background thread; `wait()` / `close()` block until done.
    """

    def __init__(self, workdir, *, max_to_keep: int | None = 3, save_interval_steps: int = 1000,
                 keep_best: bool = True, best_metric: str | None = None, best_mode: str = "max",
                 async_save: bool = True):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        # orbax refuses relative paths; users type relative ones (--workdir=runs/x).
        workdir = os.fspath(workdir)
        self.workdir = epath.Path(workdir if "://" in workdir else os.path.abspath(workdir))
        self.save_interval_steps = int(save_interval_steps)
        self.keep_best = keep_best
        self.best_metric = best_metric or "metric"
        self.best_mode = best_mode
        self._async = async_save
        # Per-run namespace for our coordination-service keys, so two Checkpointers in one
        # job (e.g. two distillation stages) never share a barrier (restore agreement only).
        self._namespace = "jtb_ckpt_" + hashlib.sha1(
            os.fspath(self.workdir).encode()).hexdigest()[:10]
        self._coord = Coordinator(self._namespace)
        self._digesters: dict[int, digests.Digester] = {}
        quiet_orbax_failures()

        self._mngr = self._make_manager(
            self.workdir / "checkpoints", "periodic",
            max_to_keep=max_to_keep,
            # No InitialSavePolicy: saves happen exactly on the interval (or when forced), so
            # the loop's behaviour does not depend on whether the directory was empty.
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
                self.save_interval_steps),
        )
        self._best_mngr = None
        self._best_value: float | None = None
        if keep_best:
            name = self.best_metric
            self._best_mngr = self._make_manager(
                self.workdir / "best", "best", max_to_keep=1, best_fn=lambda m: float(m[name]),
                best_mode=best_mode, keep_checkpoints_without_metrics=False)
            self._best_value = self._read_best_value()

    # ------------------------------------------------------------------ construction
    def _make_manager(self, directory, kind: str, **options):
        digester = digests.Digester(epath.Path(directory))
        async_options = (ocp.AsyncOptions(post_finalization_callback=digester)
                         if self._async else None)
        # Barrier names of their own per manager: orbax names several of a save's barriers
        # by the step alone (async_commit_complete.<step>, set_value_start), so the periodic
        # and the best save of one step would otherwise meet at the same barrier (see _save).
        multiprocessing = ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix=f"{self._namespace}_{kind}")
        opts = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=self._async, create=True, async_options=async_options,
            multiprocessing_options=multiprocessing, **options)
        # On a local disk the state is written without zstd: compressing a 4-layer student's
        # ~170 MB state (params, AdamW moments) cost ~0.3-0.4 CPU-s per save, while training waits
        # for the cores, to make it a third smaller (unseen vocabulary rows have zero moments);
        # a prediction epoch on SST-2 saves 12 times. To a bucket the network is the slower
        # part, so it is compressed. Either kind restores.
        remote = fs.is_remote(os.fspath(directory))
        mngr = ocp.CheckpointManager(directory, options=opts, item_handlers={
            "state": ocp.PyTreeCheckpointHandler(use_compression=remote),
            "meta": ocp.JsonCheckpointHandler()})
        self._digesters[id(mngr)] = digester
        return mngr

    def _save(self, mngr, step: int, args, **kw) -> bool:
        """mngr.save, with the step's files digested into digests.json once written; the other
        manager's save in flight finished first."""
        # One save in flight at a time over both managers. The best and the periodic save of
        # an evaluated step, at once, ran their multi-host barriers from two threads under one
        # name ("Barrier ... set_value_start is already ongoing") and aborted the job. The
        # prefixes of _make_manager keep the names apart; this wait rules the overlap out
        # whatever orbax's barriers are named (every process makes the same calls in the same
        # order, so all wait for the same save). Its cost: the rest of the other save's write.
        for other in (self._mngr, self._best_mngr):
            if other is not None and other is not mngr:
                try:
                    other.wait_until_finished()
                except BaseException as e:
                    self._raise_if_disk_full(e)
                    raise
        digester = self._digesters[id(mngr)]
        if jax.process_index() == 0:  # orbax calls the digester on process 0 only
            digester.pending.append(step)
        try:
            saved = bool(mngr.save(step, args=args, **kw))
        except BaseException as e:
            digester.discard(step)
            self._raise_if_disk_full(e)
            raise
        if not saved:
            digester.discard(step)
        elif not self._async:
            # Sync save: the step is final already; digest it now (process 0, shared files).
            digester.discard(step)
            if jax.process_index() == 0:
                digests.write(mngr.directory / str(step))
            self._coord.barrier("digests")
        return saved

    def _read_best_value(self):
        step = self._best_mngr.best_step()
        if step is None:
            return None
        try:
            m = self._best_mngr.metrics(step)
            return None if m is None else float(m[self.best_metric])
        except Exception as e:  # noqa: BLE001 - an unreadable metric must not stop training
            log.warning("could not read the best metric of %s step %d (%s); the next "
                        "save_best will replace it", self._best_mngr.directory, step, e)
            return None

    # ------------------------------------------------------------------ properties
    @property
    def directory(self) -> epath.Path:
        return self._mngr.directory

    @property
    def best_directory(self) -> epath.Path | None:
        return None if self._best_mngr is None else self._best_mngr.directory

    @property
    def best_value(self) -> float | None:
        return self._best_value

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def best_step(self) -> int | None:
        return None if self._best_mngr is None else self._best_mngr.best_step()

    # ------------------------------------------------------------------ saving
    @staticmethod
    def _args(state, meta):
        meta = dict(_to_json(meta), **{_DIGESTED: 1})
        return ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                  meta=ocp.args.JsonSave(meta))

    def maybe_save(self, step: int, state, meta: Mapping[str, Any] | None = None) -> bool:
        """Save if `step` is on the save interval. Returns whether a save was started."""
        return self.save(step, state, meta, force=False)

    def save(self, step: int, state, meta: Mapping[str, Any] | None = None, *,
             force: bool = True) -> bool:
        """Start a (possibly async) save of `state` + `meta` at `step`.

        `force=True` saves regardless of the interval. A step that already has a checkpoint is
        not overwritten (returns False), so `save(step, ..., force=True)` right after a
        `maybe_save` of the same step is harmless. Blocks only while a previous async save is
        still being written, and for the device-to-host copy of `state`.
        """
        step = int(step)
        if step in self._mngr.all_steps():
            return False
        if force or step % self.save_interval_steps == 0:
            self._check_room(step, state, self.directory)
        saved = self._save(self._mngr, step, self._args(state, meta), force=force)
        if saved:
            log.info("checkpoint step %d -> %s%s", step, self.directory,
                     " (async)" if self._async else "")
        return bool(saved)

    def is_better(self, metric: float) -> bool:
        if self._best_value is None:
            return bool(np.isfinite(metric))
        return metric > self._best_value if self.best_mode == "max" else metric < self._best_value

    def save_best(self, step: int, state, meta: Mapping[str, Any] | None, metric: float) -> bool:
        """Save to `workdir/best` if `metric` beats the best so far (per `best_mode`).

        Returns whether it was saved. Every process must pass the same `metric` (metrics
        computed by the jitted eval step are global, so they are).
        """
        if self._best_mngr is None:
            return False
        metric = float(metric)
        step = int(step)
        if not self.is_better(metric) or step in self._best_mngr.all_steps():
            return False
        self._check_room(step, state, self.best_directory)
        meta = dict(_to_json(meta))
        meta.setdefault("best", {"metric": self.best_metric, "value": metric, "step": step})
        saved = self._save(self._best_mngr, step, self._args(state, meta),
                           metrics={self.best_metric: metric}, force=True)
        if saved:
            log.info("best checkpoint step %d (%s=%.6g, previous %s) -> %s", step,
                     self.best_metric, metric, self._best_value, self.best_directory)
            self._best_value = metric
        return bool(saved)

    def wait(self):
        """Block until every started save is fully written (and old ones pruned)."""
        try:
            self._mngr.wait_until_finished()
            if self._best_mngr is not None:
                self._best_mngr.wait_until_finished()
        except BaseException as e:
            self._raise_if_disk_full(e)
            raise

    def _check_room(self, step: int, state, directory) -> None:
        """Raises DiskFull, before anything is written, when the disk of `directory` (local)
        lacks room for a checkpoint of `state`, counting the space that the saves in flight free
        when they finish (pruning old steps). A full disk found by orbax mid-write also stops
        the run, but under pages of its threads' tracebacks."""
        need = state_bytes(state) + _SLACK
        free = _free_bytes(directory)
        if free is None or free >= need:
            return
        self.settle()
        free = _free_bytes(directory)
        if free >= need:
            return
        last = self.latest_step()
        raise DiskFull(
            f"no room for the checkpoint of step {step} on the disk of {directory}: {_mb(free)} "
            f"free, one checkpoint of this run takes ~{_mb(need)}; free space there or move the "
            "workdir to a larger disk, then rerun the same command: it resumes from "
            + (f"step {last}, the last checkpoint" if last is not None else "the start"))

    def settle(self) -> None:
        """Waits for every save in flight, ignoring its failure (the caller reports its own)."""
        for mngr in (self._mngr, self._best_mngr):
            try:
                if mngr is not None:
                    mngr.wait_until_finished()
            except Exception:  # noqa: BLE001
                pass

    def _raise_if_disk_full(self, e: BaseException) -> None:
        """A save that failed for lack of space -> DiskFull (one line: where, how much is free,
        what to do), its partial files removed; anything else is left to the caller."""
        if not is_disk_full(e):
            return
        self.settle()   # no save left writing beside the removal
        removed = 0
        if jax.process_index() == 0 and not fs.is_remote(os.fspath(self.directory)):
            # Only this run writes here (workdir_lock): an unfinished step is this run's.
            for d in [self.directory] + ([self.best_directory] if self._best_mngr else []):
                for tmp in epath.Path(d).glob("*.orbax-checkpoint-tmp*"):
                    shutil.rmtree(os.fspath(tmp), ignore_errors=True)
                    removed += 1
        last = self.latest_step()
        free = _free_bytes(self.directory)
        raise DiskFull(
            f"no space left on the disk of {self.directory} while writing a checkpoint"
            + (f" ({_mb(free)} free there now" + (", after removing the unfinished one)"
                                                   if removed else ")") if free is not None else "")
            + "; free space there or move the workdir to a larger disk, then rerun the same "
            "command: it resumes from "
            + (f"step {last}, the last complete checkpoint" if last is not None
               else "the start (no checkpoint was completed)")) from e

    def close(self):
        """`wait()`, then release orbax's threads."""
        self.wait()
        self._mngr.close()
        if self._best_mngr is not None:
            self._best_mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ restoring
    def restore_latest(self, abstract_state):
        """`(step, state, meta)` of the newest readable periodic checkpoint, or None."""
        return self._restore_first_good(self._mngr, sorted(self._mngr.all_steps(), reverse=True),
                                        abstract_state)

    def restore_best(self, abstract_state):
        """`(step, state, meta)` of the best checkpoint, or None (also when keep_best=False)."""
        if self._best_mngr is None:
            return None
        best = self._best_mngr.best_step()
        steps = [] if best is None else [best]
        steps += [s for s in sorted(self._best_mngr.all_steps(), reverse=True) if s != best]
        return self._restore_first_good(self._best_mngr, steps, abstract_state)

    def restore(self, step: int, abstract_state, *, best: bool = False):
        """`(step, state, meta)` of exactly `step` (no fallback; errors propagate).

        The step's files are checked against its digests first (ValueError if damaged).
        """
        mngr = self._best_mngr if best else self._mngr
        problem = self._verify(mngr, int(step))
        if self._coord.any_process(problem is not None, f"verify_{int(step)}"):
            raise ValueError(f"checkpoint {mngr.directory / str(step)} is damaged: "
                             f"{problem or 'on another process'}")
        return self._restore_step(mngr, int(step), abstract_like(abstract_state))

    @staticmethod
    def _restore_step(mngr, step, abstract):
        """Reads `step` of `mngr` on this process alone: orbax's restore ends at a barrier
        of every process, which a process whose read failed never reaches (it goes on to the
        agreement in _restore_first_good, so each would wait for the other until a timeout).
        Each process reads its own shards (no orbax restore exchanges data), so this orbax
        Checkpointer is told this process is the only one; the agreement comes after."""
        me = jax.process_index()
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler(),
                              multiprocessing_options=alone) as reader:
            r = reader.restore(mngr.directory / str(step), args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)),
                meta=ocp.args.JsonRestore()))
        meta = dict(r["meta"] or {})
        meta.pop(_DIGESTED, None)
        return step, r["state"], meta

    def _verify(self, mngr, step) -> str | None:
        """None if the step's files match the digests written at save time, else the problem.

        Process 0 checks the contents; the others only what is cheap (each file there, with its
        size, on a local disk: a host whose view of a shared disk differs), not on a bucket,
        which every host sees alike, so that 16 hosts do not each read a 1.3 GB step."""
        step_dir = mngr.directory / str(step)
        first = jax.process_index() == 0
        if not first and fs.is_remote(os.fspath(step_dir)):
            return None
        problem = digests.verify(step_dir, content=first)
        if problem != f"no {digests.DIGESTS}":
            return problem
        # No digests.json: damage if the step's meta says it was written with them; else a
        # checkpoint of a version without digests (restored as before, unverified).
        try:
            with fs.open_file(step_dir / "meta" / "metadata") as fh:
                digested = _DIGESTED in json.load(fh)
        except (OSError, ValueError, TypeError):
            digested = False  # the orbax restore reports an unreadable meta
        if digested:
            return problem
        log.warning("checkpoint %s has no %s (written by an older version): restored "
                    "without verification", step_dir, digests.DIGESTS)
        return None

    def _restore_first_good(self, mngr, steps, abstract_state):
        """Newest step of `steps` intact and readable on every process, or None / raise.

        For each candidate, process 0 checks the files' digests (the others their presence
        and sizes, see _verify) and the results are OR-ed over processes (so a damage seen by
        one host only still moves everyone to the same older step, before orbax's collective
        restore could hang on it); then orbax restores.
        Damaged steps (digest mismatch) are always moved aside; steps orbax cannot read only
        once an older one restored (a changed state structure fails every step that way).
        """
        if not steps:
            return None
        abstract = abstract_like(abstract_state)
        damaged: list[int] = []
        bad: list[tuple[int, BaseException]] = []
        for step in steps:
            problem = self._verify(mngr, step)
            if self._coord.any_process(problem is not None, f"verify_{step}"):
                log.warning("checkpoint step %d in %s is damaged (%s); falling back to an earlier "
                            "checkpoint", step, mngr.directory, problem or "seen by another process")
                damaged.append(step)
                continue
            err = None
            try:
                got = self._restore_step(mngr, step, abstract)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint -> try older
                err = e
            # All processes must take the same branch, or they would restore different steps
            # and hang in the next collective.
            if not self._coord.any_process(err is not None, f"restore_{step}"):
                self._quarantine(mngr, damaged + [s for s, _ in bad])
                if damaged or bad:
                    log.warning("restored checkpoint step %d in %s instead of the newer, damaged "
                                "step(s) %s", step, mngr.directory,
                                sorted(damaged + [s for s, _ in bad]))
                return got
            if err is None:
                err = RuntimeError("another process could not read this checkpoint")
            log.warning("checkpoint step %d in %s is unreadable (%s: %s); falling back to an "
                        "earlier checkpoint", step, mngr.directory, type(err).__name__,
                        str(err).splitlines()[0][:300] if str(err) else "")
            bad.append((step, err))
        self._quarantine(mngr, damaged)
        if not bad:
            log.warning("no intact checkpoint in %s: every step (%s) was damaged and moved "
                        "aside; starting without one", mngr.directory, damaged)
            return None
        first_step, first_err = bad[0]
        raise RuntimeError(
            f"no checkpoint in {mngr.directory} could be restored (tried steps "
            f"{[s for s, _ in bad]}). If the state's structure changed (config change), this is "
            f"expected: use a new workdir. If step {first_step} is corrupt, move it aside.") \
            from first_err

    def _quarantine(self, mngr, steps):
        """Move damaged step directories aside (kept for inspection, out of orbax's view)."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                src = mngr.directory / str(step)
                if not src.exists():
                    continue
                dst = mngr.directory / f"corrupt_{step}"
                n = 1
                while dst.exists():
                    dst = mngr.directory / f"corrupt_{step}_{n}"
                    n += 1
                src.rename(dst)
                log.warning("moved damaged checkpoint step %d to %s", step, dst)
        self._coord.barrier("quarantine")
        mngr.reload()
        if mngr is self._best_mngr:
            self._best_value = self._read_best_value()
