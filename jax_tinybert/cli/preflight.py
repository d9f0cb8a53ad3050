"""`--check`: the first minutes of a pod run. The run's own config, on a few batches, in
<workdir>/check: the cluster started, the mesh built, the data and models loaded, a train step,
a checkpoint saved and restored, an eval, a best and a periodic save at the same step, on every
host; then one line per host and the verdict, and exit (0 when every part worked).

What the real run would fail on hours in (a host that cannot reach the coordinator, a mesh the
topology refuses, a batch the mesh cannot split, a data path one host lacks, an orbax barrier)
fails here in minutes, with the same message.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List

import jax
import numpy as np

from jax_tinybert import fs
from jax_tinybert.config import check as config_check
from jax_tinybert.errors import UserError
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.train import build, loop

CHECK_DIR = "check"
STEPS = 2       # step 1 saved, the second run restores it, trains step 2, evaluates, saves


def refuse(stage: str) -> None:
    """Raises UserError for the stages --check does not run (the demo, the mlm_head fit)."""
    if stage in ("demo", "mlm_head"):
        raise UserError(f"--check runs one training stage; the {stage} stage is not one: "
                        "check a stage's config (e.g. configs/task_distill.py:sst2_pred)")


def check_config(config, workdir: str):
    """The run's config cut to a few batches: STEPS steps, a checkpoint every step, an eval
    at the last, no export; the tokenised data cached where the real run will look."""
    refuse(config.stage)
    c = build.with_device_batch(build.with_defaults(config)).copy_and_resolve_references()
    c.train.num_steps, c.train.checkpoint_every, c.train.eval_every = STEPS, 1, STEPS
    c.train.checkpoint_seconds, c.train.log_every, c.train.compile_ahead = 0.0, 1, False
    c.train.per_device_batch = 0          # batch_size is already the global batch
    c.data.train_subset = c.train.batch_size * STEPS
    c.data.eval_subset = c.train.eval_batch_size
    c.data.cache_dir = c.data.cache_dir or fs.join(workdir, "cache")
    c.export.enabled = False
    return c


def run(config, workdir: str) -> Dict[str, float]:
    """Runs the check in <workdir>/check (removed after a pass); prints per host what it found
    (process 0) and returns process 0's numbers. Raises where the run would fail."""
    t0 = time.monotonic()
    c = check_config(config, workdir)
    where = fs.join(workdir, CHECK_DIR)
    if jax.process_index() == 0 and fs.exists(where):
        fs.rmtree(where)
    _barrier("check_start")
    short = c.copy_and_resolve_references()
    short.train.num_steps = 1
    loop.train_and_evaluate(short, where)                 # step 1, saved
    t1 = time.monotonic()
    # The resumed run is longer than the first by design: its schedule warning is not the user's.
    quiet = logging.getLogger(config_check.__name__)
    level, _ = quiet.level, quiet.setLevel(logging.ERROR)
    try:
        summary = loop.train_and_evaluate(c, where)       # restored at 1; step 2; eval; saves
    finally:
        quiet.setLevel(level)
    t2 = time.monotonic()
    mesh = shd.make_mesh({a: c.mesh[a] for a in shd.AXES})
    local = c.train.batch_size // jax.process_count()
    mine = np.array([jax.process_index(), jax.local_device_count(), local, t1 - t0, t2 - t1],
                    np.float64)
    hosts = _gather(mine)
    if jax.process_index() == 0:
        for line in report(hosts, mesh, c, summary):
            print(line, flush=True)
        fs.rmtree(where)
    return {"wall_s": time.monotonic() - t0, "processes": jax.process_count()}


def report(hosts: np.ndarray, mesh, config, summary) -> List[str]:
    """The check's lines: one per host (its devices, its slices of the batch axis, its rows,
    its time), then the run's numbers and the verdict."""
    dp = shd.data_parallel_size(mesh)
    along = mesh.devices.reshape(dp, -1)[:, 0]
    lines = [f"[check] {len(hosts)} process(es), {mesh.devices.size} device(s), mesh "
             f"{dict(mesh.shape)}; the batch's slices by process: {shd.slice_hosts(mesh)}"]
    for pid, n_local, rows, build_s, train_s in hosts:
        pid = int(pid)
        ids = sorted(d.id for d in mesh.devices.flat if d.process_index == pid)
        slices = [i for i, d in enumerate(along) if d.process_index == pid]
        lines.append(f"[check] process {pid}: {int(n_local)} local device(s) {ids}, batch slices "
                     f"{slices}, {int(rows)} train rows a step, first run {build_s:.1f} s, "
                     f"resumed run {train_s:.1f} s")
    ev = summary.get("eval_history") or []
    score = ", ".join(f"{k}={v:.4f}" for k, v in ev[-1].items()
                      if k not in ("step", "main")) if ev else ""
    rate = (summary.get("last_train") or {}).get("examples_per_s")
    lines.append(f"[check] train steps ({f'{rate:,.0f} ex/s' if rate else 'ran'}), checkpoint "
                 "save and restore, "
                 + (f"eval ({score}) with its best-checkpoint save" if score
                    else "no eval (this stage has no dev metric)")
                 + " worked on every process")
    lines.append("[check] passed: start the same command without --check")
    return lines


def _gather(row: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def _barrier(tag: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(tag)
