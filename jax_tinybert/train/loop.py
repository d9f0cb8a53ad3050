"""train_and_evaluate(config, workdir): one stage of distillation or fine-tuning.

config -> build.build_run (data, models, objective, optimizer, jitted steps) -> restore ->
programs queued for compiling ahead -> teacher cache (built while they compile) -> loop (train
step, log, eval, checkpoint) -> finish (best params, export, summary.json).
The same function runs teacher fine-tuning, general distillation, both task-distillation
phases, PKD and KD: what differs is only the config (objective, teacher, student init, data).
A preemption (SIGTERM, Ctrl-C, or a stop request) saves and raises `Preempted`; the CLI turns
it into exit code 143 (130 after Ctrl-C), and rerunning the same command resumes.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import shutil
import threading
import time
from typing import Any, Callable, Dict, Iterable, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jax_tinybert.train import build, workdir_lock
from jax_tinybert.speed import cpu, precompile, teacher_stream
from jax_tinybert import fs, flops as work
from jax_tinybert.teacher import cache as teacher_cache
from jax_tinybert.train import metrics as M
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.train import step as step_lib
from jax_tinybert.train.checkpoints import Checkpointer, check_free_space
from jax_tinybert.config.check import (ConfigValueError, check_workdir,  # noqa: F401
                                       config_fingerprint, validate_config)
from jax_tinybert.errors import UserError
from jax_tinybert.model.export import export_hf
from jax_tinybert.fs import write_json_atomic
from jax_tinybert.train.metrics_writer import MetricsWriter
from jax_tinybert.model.modeling import count_params
from jax_tinybert.train.preemption import Preempted, Preemption  # noqa: F401 (main.py: train.Preempted)
from jax_tinybert.progress import Progress, fmt_time

logger = logging.getLogger(__name__)
# train.checkpoint_seconds=-1 (auto) on an accelerator: periodic saves at least this far apart.
AUTO_CHECKPOINT_SECONDS = 30.0


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, Any]:
    """Runs one stage; returns the summary dict (also written to workdir/summary.json).
    Raises Preempted when stopped early (state saved; rerun to resume), and
    workdir_lock.WorkdirBusy, before anything is written, while another run holds the workdir."""
    t_start = time.time()
    config = build.with_defaults(config)
    validate_config(config)
    with workdir_lock.hold(workdir):
        return _run_stage(config, workdir, t_start)


def _run_stage(config: ml_collections.ConfigDict, workdir: str, t_start: float) -> Dict[str, Any]:
    """train_and_evaluate's work, the workdir held; t_start: when the call began (wall s)."""
    is_main = jax.process_index() == 0

    # ----------------------------------------------------------------- build
    check_workdir(config, workdir)
    run = build.build_run(config, workdir)
    state = run.step.init_state(run.models.student_params, config.train.seed)

    # ----------------------------------------------------------------- restore
    ckpt = Checkpointer(workdir, max_to_keep=config.train.max_to_keep,
                        save_interval_steps=config.train.checkpoint_every,
                        keep_best=run.evaluates, best_metric="main", best_mode="max")
    inputs = input_fingerprints(run)
    start_step, state, best, past = _restore(ckpt, run, state, workdir, inputs)
    if start_step < run.total_steps:
        check_free_space(workdir, state, config.train.max_to_keep, run.evaluates)
    # The run so far (carried in each checkpoint's meta), so that summary.json covers every
    # segment of a resumed run, and a finished run rerun in place keeps its history.
    history = list(past.get("eval_history", []))
    wall_before = _wall_before(workdir, start_step, past)
    compiler = (_compiler(config) if config.train.compile_ahead
                and start_step < run.total_steps else None)
    preemption, writer, drop = Preemption(), None, None
    # The SIGTERM handler must not outlive this stage when it stops early (Preempted) or fails:
    # library callers (pipeline, benchmarks) run several stages in one process.
    try:
        # Queued before the teacher cache is built, so the worker compiles while the teacher
        # runs (MRPC: the first step no longer waits ~9 s for its program after the build).
        train_step, eval_step = _steps(run, compiler, start_step)
        if start_step < run.total_steps:
            # Before the SIGTERM handler is installed, so a preemption during a build before the
            # steps stops at once; and only when steps are left to train. A build beside the
            # steps (teacher_stream.py) starts here and ends with them.
            run.ensure_cache(beside=True)
        preemption.install()

        # ------------------------------------------------------------- loop
        writer = MetricsWriter(workdir, enabled=is_main, start_step=start_step)
        beside = isinstance(run.cache, teacher_stream.StreamingCache)   # recorded at its end
        if run.cache is not None and not beside and run.cache.build_stats:
            writer.write(start_step, run.cache.build_stats, prefix="teacher_cache")
        if is_main:
            _announce(run)
        log = _TrainLog(run, writer, start_step, compiler)
        log.last = dict(past.get("last_train", {}))
        eval_every = config.train.eval_every or run.data.train_batches.steps_per_epoch
        fingerprint = config_fingerprint(config)[0]
        save_timer = SaveTimer(_checkpoint_seconds(config))
        step = start_step
        while step < run.total_steps:
            batch = next(run.data.train_batches)
            state, metrics = train_step(state, run.teacher_params, _feed(run, batch))
            step += 1
            log.step(step, batch, metrics)
            meta = {"data": run.data.train_batches.state_dict(), "best": best,
                    "config_fingerprint": fingerprint, "inputs": inputs,
                    "history": {"eval_history": history, "last_train": log.last,
                                "wall_s": wall_before + time.time() - t_start}}
            if run.evaluates and (step % eval_every == 0 or step == run.total_steps):
                ev = evaluate(eval_step, state.params["student"], run.data, run.mesh)
                improved = ckpt.is_better(ev["main"])   # the one definition of "best"
                best = _record_eval(step, ev, best, improved, writer, history)
                meta["best"] = best
                if improved:
                    ckpt.save_best(step, state, meta, ev["main"])
            _save_and_maybe_stop(config, ckpt, preemption, writer, step, run.total_steps,
                                 state, metrics, meta, workdir, save_timer)
        if beside:
            # Built beside the steps: finished (the rows no step read) and swapped for the
            # cache it wrote.
            run.cache = run.cache.result()
            if run.cache.build_stats:
                writer.write(step, run.cache.build_stats, prefix="teacher_cache")
        # The run is finished: its per-token cache goes, beside the export and the last save.
        # (Should that save fail, the rerun resumes from the one before and builds it again.)
        drop = _TokenCacheDrop(run.cache)
        # An export of the final state is written while orbax's threads finish the last
        # checkpoint (MRPC fine-tuning: 0.5 s of export beside a 1.4 s wait); the best
        # checkpoint's params are read back only once every save is on disk.
        exported = None
        if config.export.enabled and not _exports_best(best, step):
            exported = (_export(run, state.params["student"], workdir), step)
        ckpt.wait()
    except BaseException as e:
        if isinstance(run.cache, teacher_stream.StreamingCache):
            run.cache.stop()   # a build beside the steps ends with them (its folder removed)
        if drop is not None:
            drop.wait()
        # The saves in flight finish (and their orbax threads end) before the process does:
        # the last checkpoint stays usable, and no thread prints into the exit. Not after a
        # second Ctrl-C, which means now, nor with several processes, where a save in flight
        # may wait for a process that is gone.
        if not isinstance(e, KeyboardInterrupt) and jax.process_count() == 1:
            ckpt.settle()
        # A bucket workdir gets the metrics so far (locally they are on disk already).
        if writer is not None:
            writer.upload(quiet=True)
        raise
    finally:
        preemption.uninstall()
        if compiler is not None:
            logger.info("compiled ahead: %s; the others compiled in the step that first "
                        "needed them", compiler.close())
    flops = _run_flops(run, compiler)

    # ----------------------------------------------------------------- finish
    if exported is not None:
        export_dir, export_step = exported
    else:
        final_params, export_step = _best_params(ckpt, run, state, best, step)
        export_dir = _export(run, final_params, workdir) if config.export.enabled else None
    ckpt.close()
    m = run.models
    summary = {"stage": config.stage, "objective": run.objective.name, "steps": step,
               "best": best, "last_train": log.last, "eval_history": history,
               "student_params": count_params(m.student_params),
               "teacher_params": count_params(m.teacher_params) if m.teacher_params else 0,
               "wall_s": wall_before + time.time() - t_start, "export": export_dir,
               "export_step": export_step if export_dir else None, "task": run.data.task,
               **({"flops_this_segment": flops} if flops is not None else {})}
    writer.close()
    drop.finish()
    if is_main:
        write_json_atomic(os.path.join(workdir, "summary.json"), summary, indent=1,
                          default=float)
        print(f"[{config.stage}] done in {summary['wall_s']:.0f}s; "
              + (f"work {work.fmt(flops, time.time() - t_start)}"
                 + (f" since the resume at step {start_step}; " if start_step else "; ")
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


class _TokenCacheDrop:
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


# A train set of more tokens than this (a corpus on disk) is fingerprinted by its offsets, labels
# and 256 evenly spaced runs of its tokens adding up to this many, so that a start does not read
# all of it (~1 s per 100 M tokens; runs, not a stride, as a stride touches every page).
FULL_FINGERPRINT_TOKENS = 1 << 24


def _token_sample(a):
    """`a` itself, or FULL_FINGERPRINT_TOKENS of it in 256 evenly spaced runs (a memmap reads
    only those pages)."""
    if a is None or len(a) <= FULL_FINGERPRINT_TOKENS:
        return a
    n = FULL_FINGERPRINT_TOKENS // 256
    starts = np.linspace(0, len(a) - n, 256).astype(np.int64)
    return np.concatenate([np.asarray(a[s:s + n]) for s in starts])


def input_fingerprints(run: build.Run) -> Dict[str, str]:
    """What a run's steps are trained from besides its config, recorded in every checkpoint:
    "teacher" (a digest of the teacher's weights, for the stages that read them) and
    "train_data" (of the train set's token ids, segments, offsets and labels)."""
    out = {}
    if run.models.teacher_fingerprint is not None:
        out["teacher"] = run.models.teacher_fingerprint
    ds = run.data.train_dataset
    ids, offsets = getattr(ds, "input_ids", None), getattr(ds, "offsets", None)
    if ids is not None and offsets is not None:
        out["train_data"] = teacher_cache.arrays_fingerprint(
            _token_sample(ids), _token_sample(getattr(ds, "token_type_ids", None)), offsets,
            getattr(ds, "labels", None))
    return out


def _check_inputs(run: build.Run, workdir: str, step: int, saved: Dict[str, str],
                  now: Dict[str, str]) -> None:
    """Refuses to go on training from checkpoint `step` with another teacher or train set than
    the one it was trained with (same config: the paths name the same files, whose content
    changed)."""
    c = run.config
    changed = {k for k in saved.keys() & now.keys() if saved[k] != now[k]}
    if "teacher" in changed:
        raise UserError(
            f"workdir {workdir} holds a run distilled from other teacher weights: the weights at "
            f"config.teacher.path={c.teacher.path} changed after step {step} was saved "
            f"(fingerprint {saved['teacher']} -> {now['teacher']}); going on would mix two "
            f"teachers. Put the old weights back, use a new --workdir, or delete {workdir} to "
            "start over")
    if "train_data" in changed:
        src = {"glue": f"{c.data.task} in {c.data.glue_dir or os.environ.get('GLUE_DIR', '')}",
               "corpus": f"corpus {c.data.corpus}"}.get(c.data.kind, f"data.kind={c.data.kind}")
        raise UserError(
            f"workdir {workdir} holds a run trained on other data: the train set ({src}) changed "
            f"after step {step} was saved: the same number of examples, other tokens or labels "
            f"(fingerprint {saved['train_data']} -> {now['train_data']}); going on would follow "
            f"the saved data order over other examples. Put the old data back, use a new "
            f"--workdir, or delete {workdir} to start over")


def _restore(ckpt: Checkpointer, run: build.Run, state, workdir: str,
             inputs: Dict[str, str]):
    """-> (start step, state, best eval, the run's history so far) from the newest readable
    checkpoint (the data position restored too), or the fresh state at step 0. inputs: this
    run's `input_fingerprints`, checked against the checkpoint's while steps are left."""
    restored = ckpt.restore_latest(run.step.abstract_state)
    if restored is None:
        return 0, state, None, {}
    start_step, state, meta = restored
    if start_step < run.total_steps:
        _check_inputs(run, workdir, start_step, meta.get("inputs") or {}, inputs)
    try:
        run.data.train_batches.load_state_dict(meta["data"])
    except ValueError as e:   # the data of this run is not the saved run's: the user's to fix
        raise UserError(f"--workdir={workdir}: {e}") from e
    if jax.process_index() == 0:
        print(f"resumed from step {start_step} in {workdir}", flush=True)
    return start_step, state, meta.get("best"), meta.get("history") or {}


_PRINTED = set()


def print_once(line: str) -> None:
    """Prints `line` the first time this process asks: a note that holds for the whole process
    (the CPU's faster dtype) is said once, not once per stage of a pipeline such as the demo."""
    if line not in _PRINTED:
        _PRINTED.add(line)
        print(line, flush=True)


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
        labels = [build.compute_label(d) for d in dtypes]
        print("compute: " + (labels[0] if len(set(labels)) == 1 else
                             f"student {labels[0]}; teacher {labels[1]}"), flush=True)
    backend = jax.default_backend()
    hint = dtype_hint(backend, dtypes, cpu.fast_bf16() if backend == "cpu" else None)
    if hint:
        print_once(hint)


def dtype_hint(backend: str, dtypes: Iterable[str], bf16: Optional[str]) -> Optional[str]:
    """A one-line note when a model's compute dtype (`dtypes`: the student's, the teacher's) is
    the slower one on this backend (measured, benchmarks/RESULTS.md): float32 on a GPU or on a
    CPU with fast bfloat16 products (`bf16`: cpu.fast_bf16()'s answer; None off a CPU),
    bfloat16 on a CPU without them, float16 on any CPU. None otherwise."""
    dtypes = {str(d) for d in dtypes}
    if backend == "gpu" and "float32" in dtypes:
        return ("note: float32 compute on a GPU; --config.student.dtype=bfloat16 "
                "--config.teacher.dtype=bfloat16 ran the step 1.6-2.1x faster on an H200 "
                "(params, gradients and the optimizer stay float32)")
    if backend != "cpu":
        return None
    if bf16 and "float32" in dtypes:
        measured = ("1.55-1.9x faster on an Intel Xeon with AMX" if bf16 == "AMX" else
                    "1.2-1.6x faster on an AMD EPYC Zen 4, MRPC's epochs 1.2-1.4x; each "
                    "program compiles 1.5-2.5 s longer, so `make demo` gains nothing")
        return (f"note: this CPU multiplies bfloat16 fast ({bf16}); "
                "--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16 ran the steps "
                f"{measured} (bfloat16 products; activations, params and the optimizer stay "
                "float32; MRPC dev scores within 0.8 points of float32 in RESULTS.md)")
    if "float16" in dtypes:
        return ("note: float16 compute on a CPU: XLA has no float16 product kernel there, so "
                "it converts the operands and multiplies in float32, slower than float32 itself; "
                "use bfloat16 (fast on a CPU with AMX, or an AMD one with AVX512-BF16) or "
                "float32, the default")
    if not bf16 and "bfloat16" in dtypes:
        return ("note: bfloat16 compute on a CPU without AMX (or an AMD CPU with AVX512-BF16) "
                "ran its products slower than float32 (an Intel Xeon with AVX512-BF16 but no "
                "AMX); --config.student.dtype=float32 --config.teacher.dtype=float32 is the "
                "default")
    return None


class _TrainLog:
    """Train metrics every config.train.log_every steps (and at the first and last step):
    to metrics.jsonl and stdout, with examples/s and tokens/s since the previous record, and
    the steps' ETA. Non-finite metrics stop the run."""

    def __init__(self, run: build.Run, writer: MetricsWriter, start_step: int,
                 compiler: Optional[precompile.Compiler] = None):
        self.run, self.writer, self.start_step = run, writer, start_step
        self.compiler = compiler
        self.t_last, self.examples, self.tokens = time.time(), 0, 0
        self.last: Dict[str, float] = {}
        self.eta = _StepEta(run.total_steps)

    def step(self, step: int, batch, metrics) -> None:
        tc, total = self.run.config.train, self.run.total_steps
        self.examples += tc.batch_size
        self.tokens += int(batch["attention_mask"].sum()) * jax.process_count()
        record = step % tc.log_every == 0 or step == total or step == 1
        if not (record or step == self.start_step + 1):
            return
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.time()
        eta = self.eta.at(step, now, -math.inf if self.compiler is None
                          else self.compiler.quiet_since())
        dt = now - self.t_last
        m["examples_per_s"] = self.examples / dt
        m["tokens_per_s"] = self.tokens / dt
        self.t_last, self.examples, self.tokens = now, 0, 0
        check_finite(self.run.config, step, m)
        if record:
            self.writer.write(step, m, prefix="train")
            self.last = m
        if jax.process_index() == 0:
            terms = " ".join(f"{k}={v:.4g}" for k, v in m.items()
                             if k not in ("examples_per_s", "tokens_per_s", "lr", "grad_norm"))
            print(f"step {step:>6}/{total} [{100 * step / total:5.1f}%] {terms} "
                  f"lr={m['lr']:.2e} {m['examples_per_s']:.1f} ex/s"
                  + (f", ETA {fmt_time(eta)}" if eta is not None and step < total else ""),
                  flush=True)


class _StepEta:
    """Seconds left for the steps, from the mean step time over the last few logged intervals
    (up to WINDOW). Left out: intervals that shared the cores with the programs compiling ahead
    (the ETA waits for an interval after the worker's last compile), and the interval that
    starts at the first step this process ran once a later one exists (that step paid for its
    own compilation). After a README run's resume, an ETA from the first step on read 54 min,
    and one from the intervals beside the compile worker 60 min, where the lines after read 21."""

    WINDOW = 5

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.points = collections.deque(maxlen=self.WINDOW + 1)   # (step, time), oldest first
        self.logged = 0

    def at(self, step: int, now: float, quiet_since: float = -math.inf) -> Optional[float]:
        """-> seconds left, or None while no clean interval is known. `quiet_since`: the time
        since which nothing compiled beside the steps (inf: something compiles now)."""
        self.logged += 1
        if self.logged == 3:   # a later interval exists: drop the one from the first step
            self.points.popleft()
        self.points.append((step, now))
        clean = [p for p in self.points if p[1] >= quiet_since]
        if len(clean) < 2:
            return None
        (s0, t0), (s1, t1) = clean[0], clean[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (t1 - t0) / (s1 - s0) * max(0, self.total - s1)


def _record_eval(step: int, ev: Dict[str, float], best: Optional[dict], improved: bool,
                 writer: MetricsWriter, history: list) -> Optional[dict]:
    """Writes and prints an eval; -> the best eval so far ({"step", metrics...})."""
    writer.write(step, ev, prefix="eval")
    history.append({"step": step, **ev})
    if improved:
        best = {"step": step, **ev}
    if jax.process_index() == 0:
        note = "  (best)" if improved else (
            f"  (best {best['main']:.4f} @ {best['step']})" if best else "")
        print(f"eval step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()) + note,
              flush=True)
    return best


class NonFiniteLoss(UserError, FloatingPointError):
    """The loss or the gradient norm became inf / NaN: the run stops, saving nothing more."""


def check_finite(config, step: int, metrics: Dict[str, float]) -> None:
    """Raises NonFiniteLoss when a metric of `step` (host floats) is inf or NaN."""
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
        raise NonFiniteLoss(
            f"non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} at step {step}; nothing "
            "from this step on is saved (the checkpoints so far are finite); rerun with a lower "
            f"config.optim.learning_rate (now {config.optim.learning_rate:g}) in a new --workdir, "
            "or check the data")


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


def _checkpoint_seconds(config: ml_collections.ConfigDict) -> float:
    """`train.checkpoint_seconds`; -1 = auto: 0 on CPU (a step there is 0.1-3 s, so 200 are
    minutes), 30 s on an accelerator."""
    seconds = float(config.train.checkpoint_seconds)
    if seconds < 0:
        seconds = 0.0 if jax.default_backend() == "cpu" else AUTO_CHECKPOINT_SECONDS
    if seconds > 0:
        logger.info("periodic checkpoints every %d steps, at least %g s apart "
                    "(train.checkpoint_seconds); a preemption saves its step regardless",
                    config.train.checkpoint_every, seconds)
    return seconds


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


# --------------------------------------------------------------------------- eval and export

def _exports_best(best: Optional[dict], step: int) -> bool:
    """Whether the export is the best checkpoint's, read back from disk: the best eval was not
    at the last step `step`."""
    return best is not None and best["step"] != step


def _best_params(ckpt: Checkpointer, run: build.Run, state, best: Optional[dict], step: int):
    """(student params to export, their step): the best checkpoint's when `_exports_best`
    (the final state's if that checkpoint is damaged or missing)."""
    if _exports_best(best, step):
        got = ckpt.restore_best(run.step.abstract_state)
        if got is not None:
            if jax.process_index() == 0:
                print(f"exporting the best checkpoint (step {got[0]})", flush=True)
            return got[1].params["student"], got[0]
        if jax.process_index() == 0:
            print(f"the best checkpoint (step {best['step']}) is damaged or missing: "
                  f"exporting the final state (step {step}) instead", flush=True)
    return state.params["student"], step


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


def _compiler(config: ml_collections.ConfigDict) -> precompile.Compiler:
    """The compile-ahead worker threads: `train.compile_workers`, 0 = one on CPU, one per 4
    host cores (at most 4) on an accelerator."""
    workers = config.train.compile_workers   # >= 0: config_check
    if workers == 0:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        workers = precompile.auto_workers(jax.default_backend(), cpus)
    if workers > 1:
        logger.info("compiling ahead in %d threads (train.compile_workers)", workers)
    return precompile.Compiler(workers)


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
                         shd.shard_batch({k: sample[k] for k in step_lib.MODEL_KEYS}, run.mesh))
    return train_step, eval_step


def evaluate(eval_fn, params, data: build.Data, mesh) -> Dict[str, float]:
    """Runs the student over the dev set; the task's metrics on the host ("main" = the task's
    headline score)."""
    data.eval_batches.reset()
    preds, ids = [], []
    with Progress("eval", total=len(data.eval_labels), unit="ex") as prog:
        for batch in data.eval_batches:
            keep = {k: batch[k] for k in step_lib.MODEL_KEYS}
            logits = np.asarray(jax.device_get(eval_fn(params, shd.shard_batch(keep, mesh))))
            # Every process gets the global logits; keep the rows of all processes in order.
            ids.append(_allgather_host(batch["example_id"]))
            preds.append(logits)
            prog.update(int((ids[-1] >= 0).sum()))
    preds = np.concatenate(preds)
    ids = np.concatenate(ids)
    keep = ids >= 0
    preds, ids = preds[keep], ids[keep]
    labels = data.eval_labels[ids]
    p = preds[:, 0] if preds.shape[1] == 1 else preds.argmax(-1)
    out = M.compute(data.task, p, labels)
    out["main"] = M.score(data.task, p, labels)
    if preds.shape[1] > 1 and len(p) > 1 and np.all(p == p[0]) and jax.process_index() == 0:
        print(one_class_warning(int(p[0]), len(p), data.id2label,
                                float(np.mean(labels == p[0]))), flush=True)
    return out


def one_class_warning(cls: int, n: int, id2label: Optional[Dict[int, str]],
                      share: float) -> str:
    """The line printed when a classifier gives every dev example the same class: its scores
    are then the majority-class baseline's (or below), whatever they look like."""
    label = str(id2label.get(cls, cls)) if id2label else str(cls)
    name = f"class {cls}" + (f" ({label})" if label != str(cls) else "")
    return (f"[eval] warning: all {n:,} dev examples were predicted as {name}, which is "
            f"{share:.2%} of the dev labels: the model has not learned to tell the classes "
            "apart yet (train longer, or raise optim.learning_rate)")


def _export(run: build.Run, params, workdir: str) -> str:
    """workdir/export: the student as an HF folder (a bare encoder after general distillation,
    whose head was never trained). Written by process 0; every process gathers the params."""
    export_dir = os.path.join(workdir, "export")
    host = jax.tree_util.tree_map(np.asarray, _to_host(params))
    if jax.process_index() == 0:
        as_base = run.data.task is None
        export_hf(run.models.student_config, host["bert"] if as_base else host, export_dir,
                  tokenizer_dir=run.models.tokenizer_dir, id2label=run.data.id2label)
    return export_dir


def _allgather_host(x: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return x
    return np.asarray(multihost_utils.process_allgather(x)).reshape(-1)


def _to_host(tree):
    """Fully-replicated host copy of a (possibly sharded, multi-process) pytree."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
