"""`python -m jax_tinybert.main`, throttled: each process sleeps JTB_TEST_STEP_SLEEP seconds
(default 0.3) after every logged train step, so a test can signal a run mid-way at a known
point (a tiny model otherwise finishes 20 steps in a fraction of a second). Nothing else changes:
same flags, same env, same code path (`jax_tinybert.main.run()`)."""
import os
import time

from jax_tinybert import main  # noqa: F401  (sets XLA_FLAGS from JTB_CPU_DEVICES first)
from jax_tinybert import metrics_writer

_write = metrics_writer.MetricsWriter.write
_SLEEP = float(os.environ.get("JTB_TEST_STEP_SLEEP", "0.3"))


def write(self, step, metrics, prefix=""):
    _write(self, step, metrics, prefix)
    if prefix == "train":
        time.sleep(_SLEEP)


metrics_writer.MetricsWriter.write = write

if __name__ == "__main__":
    main.run()
