"""`python -m jax_tinybert.main` with the pressure and faults of tests/test_multihost.py, set by
env (nothing else changes: same flags, same code path, `jax_tinybert.main.run()`):

JTB_TEST_ALWAYS_BEST=1: every dev evaluation counts as a new best, so each one saves
  workdir/best (with eval_every = checkpoint_every, beside the periodic save of the same step).
JTB_TEST_STEP_SLEEP=S: each logged train step sleeps S seconds, as in slow_main.py.
JTB_TEST_DAMAGED_VIEW=P:S[,P:S...]: process P sees periodic step S as damaged (its digest check
  fails there only, as with a stale cache on one host).
JTB_TEST_UNREADABLE=P:S[,...]: on process P orbax fails to read periodic step S (an I/O error on
  that host only; the digests are intact).
JTB_TEST_NO_SUMMARY=P[,P...]: process P sees no summary.json anywhere (fs.exists says False,
  as on a host whose disk lacks what another host wrote): a finished stage looks unfinished there.
JTB_TEST_SLOW_INPUT=P:S: process P sleeps S seconds in each next() of its task batcher (a host
  whose input pipeline is slow: the straggler of tests/test_hosts.py).
JTB_TEST_ROWS_OUT=DIR: every corpus batch a process reads is appended to DIR/rows_p<i>.jsonl as
  {"step": global step, "rows": its example ids} (the rows each host read, for the tests).
"""
import os

from jax_tinybert import main  # noqa: F401  (sets XLA_FLAGS from JTB_CPU_DEVICES first)
from jax_tinybert.train import checkpoints, digests


def _steps(name):
    """{process: {steps}} of a P:S[,P:S...] variable."""
    out = {}
    for item in filter(None, os.environ.get(name, "").split(",")):
        p, s = item.split(":")
        out.setdefault(int(p), set()).add(int(s))
    return out


def _periodic_step(path):
    """S for a path .../checkpoints/S[/item], else None."""
    parts = os.fspath(path).rstrip("/").split("/")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] == "checkpoints" and parts[i].isdigit():
            return int(parts[i])
    return None


def _mine(table):
    import jax

    return table.get(jax.process_index(), set())


if os.environ.get("JTB_TEST_STEP_SLEEP"):
    import slow_main  # noqa: F401  (its throttle, installed at import)

if os.environ.get("JTB_TEST_ALWAYS_BEST") == "1":
    import math

    checkpoints.Checkpointer.is_better = lambda self, metric: math.isfinite(float(metric))

if _steps("JTB_TEST_DAMAGED_VIEW"):
    _damaged, _verify = _steps("JTB_TEST_DAMAGED_VIEW"), digests.verify

    def verify(step_dir, **kw):
        if _periodic_step(step_dir) in _mine(_damaged):
            return "simulated: this host's view of the files differs from the digests"
        return _verify(step_dir, **kw)

    digests.verify = verify

if _steps("JTB_TEST_UNREADABLE"):
    import orbax.checkpoint as ocp

    _unreadable, _restore = _steps("JTB_TEST_UNREADABLE"), ocp.PyTreeCheckpointHandler.restore

    def restore(self, directory, *args, **kwargs):
        if _periodic_step(directory) in _mine(_unreadable):
            raise OSError(5, "simulated: input/output error on this host", os.fspath(directory))
        return _restore(self, directory, *args, **kwargs)

    ocp.PyTreeCheckpointHandler.restore = restore

if os.environ.get("JTB_TEST_NO_SUMMARY"):
    from jax_tinybert import fs

    _blind, _exists = {int(p) for p in os.environ["JTB_TEST_NO_SUMMARY"].split(",")}, fs.exists

    # The process id from the env: fs.exists runs before jax.distributed starts (the workdir
    # check), and jax.process_index() there would start the backend too early.
    _me = int(os.environ.get("JTB_PROCESS_ID", "0"))

    def exists(path):
        if _me in _blind and os.fspath(path).endswith("/summary.json"):
            return False
        return _exists(path)

    fs.exists = exists

if os.environ.get("JTB_TEST_SLOW_INPUT"):
    import time

    from jax_tinybert.data import batching

    _who, _s = os.environ["JTB_TEST_SLOW_INPUT"].split(":")
    _slow_next = batching.BucketedBatcher.__next__

    def slow_next(self):
        if int(os.environ.get("JTB_PROCESS_ID", "0")) == int(_who):
            time.sleep(float(_s))
        return _slow_next(self)

    batching.BucketedBatcher.__next__ = slow_next

if os.environ.get("JTB_TEST_ROWS_OUT"):
    import json

    from jax_tinybert.data import reader

    _next = reader.CorpusBatcher.__next__

    def next_recorded(self):
        import jax

        batch = _next(self)
        path = os.path.join(os.environ["JTB_TEST_ROWS_OUT"], f"rows_p{jax.process_index()}.jsonl")
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": self._done, "rows": batch["example_id"].tolist()}) + "\n")
        return batch

    reader.CorpusBatcher.__next__ = next_recorded

if __name__ == "__main__":
    main.run()
