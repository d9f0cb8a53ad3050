"""train_and_evaluate(config, workdir): one stage of distillation or fine-tuning.

config -> build.build_run (data, models, objective, optimizer, jitted steps; speed knobs made
concrete) -> restore -> programs queued for compiling ahead -> teacher cache (built while they
compile) -> loop (train step, log, eval, checkpoint) -> finish (best params, export,
summary.json). The same function runs teacher fine-tuning, general distillation, both
task-distillation phases, PKD and KD: what differs is only the config (objective, teacher,
student init, data). A preemption (SIGTERM, Ctrl-C, or a stop request) saves and raises
`Preempted`; the CLI turns it into exit code 143 (130 after Ctrl-C), and rerunning the same
command resumes.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Callable, Dict, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jax_tinybert import fs, speed
from jax_tinybert import flops as work
from jax_tinybert.config.check import check_workdir, config_fingerprint, validate_config
from jax_tinybert.model.modeling import count_params
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.speed import dtypes as speed_dtypes
from jax_tinybert.speed import precompile
from jax_tinybert.teacher import stream as teacher_stream
from jax_tinybert.train import build, hosts, workdir_lock
from jax_tinybert.train import step as step_lib
from jax_tinybert.train.checkpoints import Checkpointer, check_free_space
from jax_tinybert.train.evaluate import best_params, evaluate, export, exports_best
from jax_tinybert.train.log import TrainLog, check_finite, print_once, record_eval
from jax_tinybert.train.metrics_writer import MetricsWriter
from jax_tinybert.train.preemption import Preempted, Preemption  # noqa: F401 (cli/main.py)
from jax_tinybert.train.resume import input_fingerprints, restore

logger = logging.getLogger(__name__)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, Any]:
    """Runs one stage; returns the summary dict (also written to workdir/summary.json).
    Raises Preempted when stopped early (state saved; rerun to resume), and
    workdir_lock.WorkdirBusy, before anything is written, while another run holds the workdir."""
    t_start = time.time()
    config = build.with_device_batch(build.with_defaults(config))
    validate_config(config)
    with workdir_lock.hold(workdir):
        return _run_stage(config, workdir, t_start)


def _run_stage(config: ml_collections.ConfigDict, workdir: str, t_start: float) -> Dict[str, Any]:
    """train_and_evaluate's work, the workdir held; t_start: when the call began (wall s)."""
    # ----------------------------------------------------------------- build
    check_workdir(config, workdir)
    run = build.build_run(config, workdir)
    config = run.config   # its speed knobs concrete
    state = run.step.init_state(run.models.student_params, config.train.seed)

    # ----------------------------------------------------------------- restore
    ckpt = Checkpointer(workdir, max_to_keep=config.train.max_to_keep,
                        save_interval_steps=config.train.checkpoint_every,
                        keep_best=run.evaluates, best_metric="main", best_mode="max")
    inputs = input_fingerprints(run)
    start, state, best, past = restore(ckpt, run, state, workdir, inputs)
    if start < run.total_steps:
        check_free_space(workdir, state, config.train.max_to_keep, run.evaluates)
    # The run so far (carried in each checkpoint's meta), so that summary.json covers every
    # segment of a resumed run, and a finished run rerun in place keeps its history.
    seg = _Segment(t_start, _wall_before(workdir, start, past), inputs, best,
                   list(past.get("eval_history", [])))

    # ----------------------------------------------------------------- train
    teardown = _Teardown(run, ckpt)
    with contextlib.ExitStack() as stack:
        compiler = _compile_ahead(run, start, stack)
        # Queued before the teacher cache is built, so the worker compiles while the teacher
        # runs (MRPC: the first step no longer waits ~9 s for its program after the build).
        train_step, eval_step = _steps(run, compiler, start)
        if start < run.total_steps:
            # Before the SIGTERM handler is installed, so a preemption during a build before the
            # steps stops at once; a build beside the steps (teacher/stream.py) starts here.
            run.ensure_cache(beside=True)
        preemption = Preemption()
        preemption.install()
        stack.callback(preemption.uninstall)
        stack.push(teardown.__exit__)   # first out: before the handler goes and the worker ends
        teardown.writer = writer = MetricsWriter(workdir, enabled=jax.process_index() == 0,
                                                 start_step=start)
        log = TrainLog(run, writer, start, compiler)
        log.last = dict(past.get("last_train", {}))
        step, state = _train(run, ckpt, state, start, train_step, eval_step, log, preemption,
                             seg, workdir)
        exported = _end_of_steps(run, ckpt, state, step, seg, writer, workdir, teardown)
    flops = _run_flops(run, compiler)

    # ----------------------------------------------------------------- finish
    return _finish(run, ckpt, state, step, start, seg, log, writer, teardown.drop, exported,
                   flops, workdir)


class _Segment:
    """This call's share of a run: when it started, the seconds of the segments before it, the
    inputs' fingerprints, and the evaluations so far (the best one apart)."""

    def __init__(self, t_start: float, wall_before: float, inputs: Dict[str, str],
                 best: Optional[dict], history: list):
        self.t_start, self.wall_before, self.inputs = t_start, wall_before, inputs
        self.best, self.history = best, history

    def wall_s(self) -> float:
        return self.wall_before + time.time() - self.t_start


class _Teardown:
    """What a stage that stops early or fails leaves tidy: a build beside the steps stopped (its
    folder removed), the per-token cache's deletion waited for, the saves in flight finished
    (their orbax threads ended: the last checkpoint stays usable and no thread prints into the
    exit; not after a second Ctrl-C, which means now, nor with several processes, where a save
    in flight may wait for a process that is gone), a bucket workdir's metrics uploaded."""

    def __init__(self, run: build.Run, ckpt: Checkpointer):
        self.run, self.ckpt, self.writer, self.drop = run, ckpt, None, None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None:
            return False
        if isinstance(self.run.cache, teacher_stream.StreamingCache):
            self.run.cache.stop()
        if self.drop is not None:
            self.drop.wait()
        if not isinstance(error, KeyboardInterrupt) and jax.process_count() == 1:
            self.ckpt.settle()
        if self.writer is not None:
            self.writer.upload(quiet=True)
        return False


def _compile_ahead(run: build.Run, start: int, stack: contextlib.ExitStack):
    """The compile-ahead worker (train.compile_workers threads), closed with the stack; None
    when train.compile_ahead is off or no steps are left."""
    tc = run.config.train
    if not tc.compile_ahead or start >= run.total_steps:
        return None
    if tc.compile_workers > 1:
        logger.info("compiling ahead in %d threads (train.compile_workers)", tc.compile_workers)
    compiler = precompile.Compiler(tc.compile_workers)
    stack.callback(lambda: logger.info("compiled ahead: %s; the others compiled in the step "
                                       "that first needed them", compiler.close()))
    return compiler


def _train(run: build.Run, ckpt: Checkpointer, state, start: int, train_step, eval_step,
           log: TrainLog, preemption: Preemption, seg: _Segment, workdir: str):
    """The steps from `start` to the end: train, log, evaluate, checkpoint. -> (step, state)."""
    config, writer = run.config, log.writer
    cache_stats(run, writer, start)
    if jax.process_index() == 0:
        _announce(run)
    eval_every = config.train.eval_every or run.data.train_batches.steps_per_epoch
    fingerprint = config_fingerprint(config)[0]
    save_timer = SaveTimer(float(config.train.checkpoint_seconds))
    if save_timer.min_seconds > 0:
        logger.info("periodic checkpoints every %d steps, at least %g s apart "
                    "(train.checkpoint_seconds); a preemption saves its step regardless",
                    config.train.checkpoint_every, save_timer.min_seconds)
    step = start
    profiler = hosts.StepProfiler(config, workdir, start)
    try:
        while step < run.total_steps:
            profiler.before(step + 1)
            with profiler.annotate(step + 1):
                t = time.perf_counter()
                batch = next(run.data.train_batches)
                fed = _feed(run, batch)
                log.hosts.waited(time.perf_counter() - t)   # the wait for its batch: read + feed
                state, metrics = train_step(state, run.teacher_params, fed)
            step += 1
            profiler.after(step, metrics["loss"])
            log.step(step, batch, metrics)
            meta = {"data": run.data.train_batches.state_dict(), "best": seg.best,
                    "config_fingerprint": fingerprint, "inputs": seg.inputs,
                    "history": {"eval_history": seg.history, "last_train": log.last,
                                "wall_s": seg.wall_s()}}
            if run.evaluates and (step % eval_every == 0 or step == run.total_steps):
                ev = evaluate(eval_step, state.params["student"], run.data, run.mesh)
                improved = ckpt.is_better(ev["main"])   # the one definition of "best"
                seg.best = meta["best"] = record_eval(step, ev, seg.best, improved, writer,
                                                      seg.history)
                if improved:
                    ckpt.save_best(step, state, meta, ev["main"])
            _save_and_maybe_stop(config, ckpt, preemption, writer, step, run.total_steps,
                                 state, metrics, meta, workdir, save_timer)
    finally:
        profiler.close()   # a trace still running when the run stops is kept
    return step, state


def cache_stats(run: build.Run, writer: MetricsWriter, step: int) -> None:
    """The teacher cache's build statistics to the metrics (a build beside the steps: at its end)."""
    if run.cache is not None and not isinstance(run.cache, teacher_stream.StreamingCache) \
            and run.cache.build_stats:
        writer.write(step, run.cache.build_stats, prefix="teacher_cache")


def _end_of_steps(run: build.Run, ckpt: Checkpointer, state, step: int, seg: _Segment,
                  writer: MetricsWriter, workdir: str, teardown: _Teardown):
    """After the last step: a cache built beside the steps finished, the per-token cache's
    deletion started (held by `teardown` from then on), the final state exported while orbax
    finishes the last checkpoint (MRPC fine-tuning: 0.5 s of export beside a 1.4 s wait).
    -> (export dir, step), or None when the export is the best checkpoint's, read back once
    every save is on disk."""
    if isinstance(run.cache, teacher_stream.StreamingCache):
        run.cache = run.cache.result()   # the rows no step read written, then the plain cache
        if run.cache.build_stats:
            writer.write(step, run.cache.build_stats, prefix="teacher_cache")
    # (Should the last save fail, the rerun resumes from the one before and builds it again.)
    teardown.drop = teacher_stream.TokenCacheDrop(run.cache)
    exported = None
    if run.config.export.enabled and not exports_best(seg.best, step):
        exported = (export(run, state.params["student"], workdir), step)
    ckpt.wait()
    return exported


def _finish(run: build.Run, ckpt: Checkpointer, state, step: int, start: int, seg: _Segment,
            log: TrainLog, writer: MetricsWriter, drop, exported, flops: Optional[float],
            workdir: str) -> Dict[str, Any]:
    """The export (the best checkpoint's where that was not the last step), summary.json, the
    closing line. -> the summary."""
    config, best = run.config, seg.best
    if exported is not None:
        export_dir, export_step = exported
    else:
        final_params, export_step = best_params(ckpt, run, state, best, step)
        export_dir = export(run, final_params, workdir) if config.export.enabled else None
    ckpt.close()
    m = run.models
    summary = {"stage": config.stage, "objective": run.objective.name, "steps": step,
               "best": best, "last_train": log.last, "eval_history": seg.history,
               "student_params": count_params(m.student_params),
               "teacher_params": count_params(m.teacher_params) if m.teacher_params else 0,
               "wall_s": seg.wall_s(), "export": export_dir,
               "export_step": export_step if export_dir else None, "task": run.data.task,
               **({"flops_this_segment": flops} if flops is not None else {})}
    writer.close()
    drop.finish()
    if jax.process_index() == 0:
        fs.write_json_atomic(os.path.join(workdir, "summary.json"), summary, indent=1,
                             default=float)
        print(f"[{config.stage}] done in {summary['wall_s']:.0f}s; "
              + (f"work {work.fmt(flops, time.time() - seg.t_start)}"
                 + (f" since the resume at step {start}; " if start else "; ")
                 if flops else "")
              + (f"best {run.data.task} {best['main']:.4f} at step {best['step']}; "
                 if best else "")
              + (f"exported to {export_dir}" if export_dir else ""), flush=True)
    return summary


# --------------------------------------------------------------------------- loop helpers

def _run_flops(run: build.Run, compiler: Optional[precompile.Compiler]) -> Optional[float]:
    """This segment's FLOPs (this call of train_and_evaluate: a resumed run's since the resume)
    by XLA's cost analysis: the teacher cache pass (when it ran here) and every train and eval
    step call; None when a part was not counted (steps compiled in the step,
    `train.compile_ahead=False`, a backend without a count)."""
    steps = compiler.flops() if compiler is not None else None
    stats = run.cache.build_stats if run.cache is not None else None
    if steps is None or (stats and "flops" not in stats):
        return None
    return steps + (stats["flops"] if stats else 0.0)


def _announce(run: build.Run) -> None:
    c, m = run.config, run.models
    # The architecture as built: with student.init='pretrained' it is the export's, whatever
    # config.student's size fields say.
    arch = lambda cfg: f"{cfg.num_hidden_layers}L-H{cfg.hidden_size} "
    print(f"[{c.stage}] objective={run.objective.name} "
          f"student={arch(m.student_config)}{count_params(m.student_params):,} params"
          + (f" (from {c.student.path or c.teacher.path})" if c.student.init == "pretrained"
             else f" ({c.student.init})") + ", "
          f"teacher={arch(m.teacher_config) if m.teacher_params else ''}"
          f"{count_params(m.teacher_params) if m.teacher_params else 0:,} params; "
          f"{run.total_steps} steps of {c.train.batch_size} on {jax.device_count()} "
          f"device(s) (mesh {dict(run.mesh.shape)}), "
          f"{run.data.train_batches.steps_per_epoch} steps/epoch", flush=True)
    # Fine-tuning has no teacher: its dtype setting is not used.
    dtypes = [c.student.dtype] + ([c.teacher.dtype] if m.teacher_params is not None else [])
    if set(dtypes) != {"float32"}:
        labels = [speed_dtypes.compute_label(d, speed.backend()) for d in dtypes]
        print("compute: " + (labels[0] if len(set(labels)) == 1 else
                             f"student {labels[0]}; teacher {labels[1]}"), flush=True)
    hint = speed_dtypes.startup_note(speed.backend(), dtypes)
    if hint:
        print_once(hint)


class SaveTimer:
    """Keeps periodic checkpoints at least `min_seconds` apart: on a GPU 200 steps are ~1.5 s
    and each save ~0.4 s (the state read back, orbax's start), a quarter of an SST-2 epoch.
    `due()` is asked at each multiple of `train.checkpoint_every`; with several processes the
    first one's clock decides for all (the save is collective)."""

    def __init__(self, min_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.min_seconds, self._clock = float(min_seconds), clock
        self._last = clock()

    def due(self) -> bool:
        if self.min_seconds <= 0:
            return True
        now = self._clock()
        ok = now - self._last >= self.min_seconds
        if jax.process_count() > 1:
            ok = bool(multihost_utils.broadcast_one_to_all(np.asarray(ok)))
        if ok:
            self._last = now
        return ok


def _save_and_maybe_stop(config, ckpt: Checkpointer, preemption: Preemption,
                         writer: MetricsWriter, step: int, total: int, state, metrics, meta: dict,
                         workdir: str, save_timer: SaveTimer) -> None:
    """The periodic / final checkpoint; on a preemption (agreed by every process, within a
    step or two of the signal), a final save and `Preempted`. A step whose metrics (loss,
    gradient norm) are not finite is never saved, logged or not."""
    def finite():   # the save reads the state back anyway: this sync costs nothing more
        check_finite(config, step, {k: float(v) for k, v in jax.device_get(metrics).items()})

    periodic = (step != total and step % ckpt.save_interval_steps == 0 and save_timer.due())
    if step == total or periodic:
        finite()
        ckpt.save(step, state, meta, force=True)
    if preemption.poll(step, metrics["loss"]):
        finite()
        ckpt.save(step, state, meta, force=True)
        ckpt.close()
        writer.close()
        preemption.uninstall()
        if jax.process_index() == 0:   # the exception's message, less the workdir
            print(Preempted(step, signum=preemption.signum), flush=True)
        raise Preempted(step, workdir, preemption.signum)


def _wall_before(workdir: str, start_step: int, past: dict) -> float:
    """Seconds spent by the earlier segments of this run: up to the restored checkpoint, or
    the whole previous run when it had finished (its summary.json is at the same step)."""
    try:
        with fs.open_file(fs.join(workdir, "summary.json")) as fh:
            done = json.load(fh)
        if done.get("steps") == start_step and start_step > 0:
            return float(done["wall_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return float(past.get("wall_s", 0.0))


def _feed(run: build.Run, batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
    """A batcher's batch -> the train step's sharded batch (the teacher cache's fields added to
    `batch` too)."""
    if run.cache is not None:
        batch.update(run.cache.lookup(batch["example_id"], seq_len=batch["input_ids"].shape[1]))
    return shd.shard_batch({k: v for k, v in batch.items() if k != "example_id"}, run.mesh)


def _sample_feed(run: build.Run, batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
    """`_feed`'s batch for compiling the step ahead: the same shapes, dtypes and shardings, with
    zeros for the teacher cache's fields while the cache is not built yet."""
    if run.cache is None and run.cache_spec is not None:
        spec = run.cache_spec(batch)
        batch = dict(batch, **{k: np.zeros(v.shape, v.dtype) for k, v in spec.items()})
    return _feed(run, batch)


def _first_of_each_length(seq_lens: np.ndarray) -> np.ndarray:
    """Indices of the first step of each distinct length, in the order they come."""
    _, first = np.unique(seq_lens, return_index=True)
    return np.sort(first)


def _steps(run: build.Run, compiler: Optional[precompile.Compiler], start_step: int):
    """-> (train_step, eval_step): the run's jitted steps, or with a compiler, the same steps
    with the program of every bucket that the steps left and the evaluations meet queued for
    compiling ahead (precompile.py), train buckets in the order they come, then eval's."""
    if compiler is None:
        return run.step.train_step, run.step.eval_step
    batches, state_abs = run.data.train_batches, run.step.abstract_state
    step = run.step.train_step
    if isinstance(step, step_lib.SplitTrainStep):
        # The update's one program first: every step needs it; the gradients' per bucket.
        update = compiler.wrap(step.update, "update step")
        update.submit(state_abs, state_abs.params)
        train_step = step_lib.SplitTrainStep(compiler.wrap(step.grads, "gradient step"), update)
        per_bucket = train_step.grads
    else:
        train_step = per_bucket = compiler.wrap(step, "train step")
    left, epoch, pos = run.total_steps - start_step, batches.epoch, batches.step
    seen = set()
    while left > 0 and len(seen) < len(batches.buckets):
        if pos >= batches.steps_per_epoch:
            epoch, pos = epoch + 1, 0
        lens = batches.epoch_plan(epoch).seq_lens[pos:pos + left]
        for i in _first_of_each_length(lens):
            if int(lens[i]) not in seen:
                seen.add(int(lens[i]))
                sample = batches.batch_at(epoch, pos + int(i))
                per_bucket.submit(state_abs, run.teacher_params, _sample_feed(run, sample))
        left, pos = left - len(lens), pos + len(lens)
    if not run.evaluates:
        return train_step, None
    eval_step = compiler.wrap(run.step.eval_step, "eval step")
    ev = run.data.eval_batches
    for i in _first_of_each_length(ev.epoch_plan(0).seq_lens):
        sample = ev.batch_at(0, int(i))
        eval_step.submit(state_abs.params["student"],
                         shd.shard_batch({k: sample[k] for k in step_lib.EVAL_KEYS}, run.mesh))
    return train_step, eval_step
