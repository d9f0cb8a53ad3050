"""Command line: python -m jax_tinybert.main --config=configs/<stage>.py[:variant] --workdir=DIR

Every config field can be overridden: --config.train.batch_size=64 --config.data.task=mrpc.
Multi-process: env JTB_COORDINATOR / JTB_NUM_PROCESSES / JTB_PROCESS_ID (or the flags below),
or SLURM / TPU VM auto-detection; JTB_CPU_DEVICES=N simulates N devices on the CPU.
"""
import os
import sys


def _early_env() -> None:
    # Must happen before JAX is imported: device count and allocator flags are read at start.
    n = os.environ.get("JTB_CPU_DEVICES")
    if n:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


_early_env()

from absl import app, flags, logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file, e.g. configs/demo.py "
                                "or configs/task_distill.py:sst2_pred", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the export.")
flags.DEFINE_string("coordinator", None, "host:port of process 0 for multi-process runs.")
flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index (0-based).")
flags.DEFINE_integer("init_timeout", 120, "Seconds to wait for the other processes to join.")
flags.DEFINE_integer("heartbeat_timeout", None, "Seconds without a heartbeat after which a "
                     "process counts as dead and the others abort (default: env "
                     "JTB_HEARTBEAT_TIMEOUT, else JAX's 100).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    import logging

    from jax_tinybert import sharding

    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("jax_tinybert").setLevel(logging.INFO)
    sharding.maybe_initialize_distributed(FLAGS.coordinator, FLAGS.num_processes,
                                          FLAGS.process_id, timeout_s=FLAGS.init_timeout,
                                          heartbeat_timeout_s=FLAGS.heartbeat_timeout)
    import jax

    if jax.process_index() != 0:
        absl_logging.set_verbosity(absl_logging.ERROR)
        logging.getLogger("jax_tinybert").setLevel(logging.WARNING)
    config = FLAGS.config
    if config.stage == "demo":
        from jax_tinybert import pipeline

        pipeline.run_demo(config, FLAGS.workdir)
    else:
        from jax_tinybert import train

        train.train_and_evaluate(config, FLAGS.workdir)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
