"""`python -m jax_tinybert.main`, throttled: each process sleeps JTB_TEST_STEP_SLEEP seconds
(default 0.3) after every logged train step, so a test can signal a run mid-way at a known
point (a tiny model otherwise finishes 20 steps in a fraction of a second). Nothing else changes:
same flags, same env, same code path (`jax_tinybert.main.run()`).

JTB_TEST_DEVICE_STEP_MATMULS=n instead makes each train step itself slow *on the device*: n
extra 512x512 matmuls inside the jitted step (reported as the metric `device_work`), so the host
can run ahead of the device the way it does on an accelerator (a host callback would not do:
on CPU a step holding one runs inline, at dispatch)."""
import os
import signal
import time

# Python's own Ctrl-C handler, as in a terminal: a test runner's worker may ignore SIGINT, and
# an ignored SIGINT is inherited (the CLI takes Ctrl-C only where Python's handler is in place).
signal.signal(signal.SIGINT, signal.default_int_handler)

from jax_tinybert import main  # noqa: E402,F401  (sets XLA_FLAGS from JTB_CPU_DEVICES first)
from jax_tinybert.train import metrics_writer  # noqa: E402
from jax_tinybert.train import step as step_lib  # noqa: E402

_write = metrics_writer.MetricsWriter.write
_SLEEP = float(os.environ.get("JTB_TEST_STEP_SLEEP", "0.3"))
_DEVICE_MATMULS = int(os.environ.get("JTB_TEST_DEVICE_STEP_MATMULS", "0"))

def write(self, step, metrics, prefix=""):
    _write(self, step, metrics, prefix)
    if prefix == "train" and not _DEVICE_MATMULS:
        time.sleep(_SLEEP)


metrics_writer.MetricsWriter.write = write

if _DEVICE_MATMULS:
    import jax
    import jax.numpy as jnp

    _make_update_step = step_lib.make_update_step

    # In the update, the program every train step runs last (fused or split).
    def make_update_step(*args, **kwargs):
        inner = _make_update_step(*args, **kwargs)

        def update(state, grads, numbers):
            new_state, metrics = inner(state, grads, numbers)
            x = jnp.full((512, 512), new_state.step.astype(jnp.float32) * 1e-6 + 1 / 512)
            x = jax.lax.fori_loop(0, _DEVICE_MATMULS, lambda i, y: jnp.tanh(y @ y), x)
            return new_state, dict(metrics, device_work=x[0, 0])

        return update

    step_lib.make_update_step = make_update_step

if __name__ == "__main__":
    main.run()
