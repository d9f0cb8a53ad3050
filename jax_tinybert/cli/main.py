"""Command line: jax-tinybert (= python -m jax_tinybert.main) --config=configs/<stage>.py[:variant]
--workdir=DIR [--config.section.field=value ...]

`--help` lists the stages, the config files and their variants and every field with its
default (jax_tinybert/cli/help.py). A mistake in the command line, a config value, a path or
the data prints one line `error: <problem>; <fix>` on stderr and exits with status 2 (the
traceback too with --verbose); any other exception is a bug and keeps its traceback.
Multi-process: env JTB_COORDINATOR / JTB_NUM_PROCESSES / JTB_PROCESS_ID (or the flags below),
else the cluster JAX detects (--cluster / JTB_CLUSTER: auto, none, gcetpu, gketpu, slurm, ompi,
...; jax_tinybert/parallel/cluster.py); JTB_CPU_DEVICES=N simulates N devices on the CPU.
Compiled steps are cached across runs in ~/.cache/jax_tinybert/xla (JTB_COMPILE_CACHE=off: not),
teacher outputs in ~/.cache/jax_tinybert/teacher (JTB_TEACHER_STORE=DIR or off; teacher_store.py),
and tokenised GLUE splits in ~/.cache/jax_tinybert/tokens (JTB_TOKEN_STORE=DIR or off).
On glibc the command restarts itself once with the allocator XLA's CPU steps run fastest under
(jax_tinybert/speed/malloc.py: tcmalloc where installed, else glibc's malloc with tuned settings),
unless the environment has its own (JTB_MALLOC=glibc: no tcmalloc; off: never).
On a GPU, XLA compiles without autotuning its GEMMs (~20 s a program instead of ~2 min;
jax_tinybert/speed/xla_flags.py): JTB_GPU_AUTOTUNE=1 keeps XLA's defaults.
"""
import os
import sys

from jax_tinybert.cli import check_installed  # (imports no dependency)

check_installed()

from jax_tinybert import fs  # noqa: E402
from jax_tinybert.speed import malloc, xla_flags  # noqa: E402

if __name__ == "__main__":
    malloc.restart_command()   # before JAX is imported (cli/__init__.py: the same)


def _early_env() -> None:
    # Must happen before JAX is imported: device count and allocator flags are read at start.
    n = os.environ.get("JTB_CPU_DEVICES")
    # jax reads its JAX_* variables at import, and a caller (a test, a script) may have imported
    # it before this module: then what is set here must also go to jax.config (XLA_FLAGS are
    # read later, when the backend starts).
    to_jax = {}
    if n:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        if "JAX_PLATFORMS" not in os.environ:
            os.environ["JAX_PLATFORMS"] = to_jax["jax_platforms"] = "cpu"
    # Persistent XLA compilation cache: every stage, resumed run and later epoch of the same
    # shapes reuses the compiled steps (one compilation per bucket costs ~5-9 s on 2 CPU
    # cores). JTB_COMPILE_CACHE=off disables it; JAX_COMPILATION_CACHE_DIR picks the folder.
    root = fs.cache_root()
    if root and not fs.env_off("JTB_COMPILE_CACHE"):
        to_jax["jax_compilation_cache_dir"] = os.environ.setdefault(
            "JAX_COMPILATION_CACHE_DIR", os.path.join(root, "xla"))
        # JAX keeps only programs that took >= 1 s to compile: the optimizer's update (~1 s on
        # 2 cores) and the dev evaluation's (~0.6 s a bucket) were compiled again by every run.
        to_jax["jax_persistent_cache_min_compile_time_secs"] = float(os.environ.setdefault(
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
    # XLA's GPU defaults autotune every GEMM at compile time, ~2 min a program (xla_flags.py).
    flags = os.environ.get("XLA_FLAGS", "")
    fast = xla_flags.with_gpu_fast_compile(flags)
    if fast != flags:
        os.environ["XLA_FLAGS"] = fast
    if "jax" in sys.modules:
        for name, value in to_jax.items():
            sys.modules["jax"].config.update(name, value)


_early_env()

import logging  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import app, flags, logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jax_tinybert.train import build, mlm_head, preemption, loop as train  # noqa: E402
from jax_tinybert.cli import diagnose as cli_diagnose, help as cli_help, demo as pipeline  # noqa: E402
from jax_tinybert.cli import preflight  # noqa: E402
from jax_tinybert.config import check as config_check  # noqa: E402
from jax_tinybert.parallel import sharding  # noqa: E402
from jax_tinybert.errors import EXIT_USER_ERROR, UserError, is_disk_full, one_line  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file, e.g. configs/demo.py "
                                "or configs/task_distill.py:sst2_pred", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the export: a "
                    "local folder or a bucket (gs://bucket/run), for every stage and the demo.")
flags.DEFINE_string("coordinator", None, "host:port of process 0 for multi-process runs.")
flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index (0-based).")
flags.DEFINE_string("cluster", None, "Without --coordinator, how a multi-process job is found "
                    "(env JTB_CLUSTER): auto (default: the first cluster JAX detects, e.g. a "
                    "Cloud TPU VM pod, GKE TPUs, a SLURM step, Open MPI), none (one process), "
                    "or one of JAX's methods: gcetpu, gketpu, slurm, ompi, mpi4py, k8s.")
flags.DEFINE_integer("init_timeout", 120, "Seconds to wait for the other processes to join.")
flags.DEFINE_integer("heartbeat_timeout", None, "Seconds without a heartbeat after which a "
                     "process counts as dead and the others abort (default: env "
                     "JTB_HEARTBEAT_TIMEOUT, else JAX's 100).")
flags.DEFINE_bool("check", False, "Pre-flight check: the run's config on a few batches in "
                  "<workdir>/check (cluster, mesh, data, models, a train step, checkpoint save and "
                  "restore, an eval on every host), one line per host, then exit.")
flags.DEFINE_bool("verbose", False, "Print the full traceback of every error (by default a "
                  "mistake in the command line, config, paths or data prints one line).")
flags.mark_flags_as_required(["config", "workdir"])

HELP_ARGS = ("-h", "-help", "--help", "--helpshort", "-?")


def _parse_flags(argv):
    """FLAGS(argv), with every failure caused by the command line turned into a UserError."""
    try:
        args = FLAGS(argv)
    except Exception as e:
        err = cli_diagnose.diagnose(argv, e)
        if err is e:
            raise
        raise err from e
    if not isinstance(FLAGS["config"].value, ml_collections.ConfigDict):
        # config_flags defers a missing config file until the config is first read.
        cli_diagnose.load_config(cli_diagnose.config_arg(argv) or "")
    return args


def _check_workdir(workdir: str) -> None:
    if not workdir.strip():
        raise UserError("--workdir is empty; pass the folder for checkpoints, metrics and the "
                        "export, e.g. --workdir=runs/sst2/teacher")
    if fs.is_remote(workdir):
        # Every output goes through jax_tinybert/fs.py (etils.epath) and orbax: a bucket URL
        # works as a workdir once its fsspec backend is there and the bucket answers.
        if not workdir.startswith("gs://"):
            raise UserError(f"--workdir={workdir}: only gs:// buckets (and local folders) are "
                            "supported as a workdir; for another store mount it and pass the "
                            "mount path")
        if len(workdir.rstrip("/")) <= len("gs://") or workdir[5:].startswith("/"):
            raise UserError(f"--workdir={workdir}: name a bucket, e.g. --workdir=gs://my-bucket/run")
        try:
            fs.check_reachable(workdir)
        except OSError as e:
            raise UserError(f"--workdir={workdir}: {one_line(e)}") from e
    if fs.exists(workdir) and not fs.isdir(workdir):
        raise UserError(f"--workdir={workdir} is a file, not a folder; pass a folder (it is "
                        "created if missing)")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected argument {argv[1]!r}; every option is a flag of the form "
                        "--name=value (see jax-tinybert --help)")
    _check_workdir(FLAGS.workdir)
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("jax_tinybert").setLevel(logging.DEBUG if FLAGS.verbose else logging.INFO)
    sharding.maybe_initialize_distributed(FLAGS.coordinator, FLAGS.num_processes,
                                          FLAGS.process_id, timeout_s=FLAGS.init_timeout,
                                          heartbeat_timeout_s=FLAGS.heartbeat_timeout,
                                          cluster=FLAGS.cluster)
    if jax.process_index() != 0:
        absl_logging.set_verbosity(absl_logging.ERROR)
        logging.getLogger("jax_tinybert").setLevel(logging.WARNING)
    config = FLAGS.config
    if FLAGS.check:
        preflight.refuse(config.stage)
    if config.stage == "mlm_head":
        # Its own schema (config.mlm.*), checked by mlm_head.fit before anything is written.
        mlm_head.fit(config, FLAGS.workdir)
        return
    # Objective / optimizer fields left at None take the named one's defaults.
    config = build.with_defaults(config)
    # Every field's range, before anything is written (the demo's stages check again).
    config_check.validate_config(config)
    logging.getLogger("jax_tinybert").info("allocator: %s", malloc.allocator())
    note = xla_flags.backend_note(jax.default_backend(), os.environ.get("XLA_FLAGS", ""))
    if note:
        logging.getLogger("jax_tinybert").info(note)
    try:
        if FLAGS.check:
            preflight.run(config, FLAGS.workdir)
        elif config.stage == "demo":
            pipeline.run_demo(config, FLAGS.workdir)
        else:
            train.train_and_evaluate(config, FLAGS.workdir)
    except train.Preempted as e:
        # 128 + the signal (143 SIGTERM, 130 Ctrl-C): what schedulers and shells expect of a
        # job that stopped on their signal.
        sys.exit(e.exit_code)


def _wants_verbose(argv) -> bool:
    verbose = False
    for a in argv[1:]:
        if a in ("--verbose", "-verbose"):
            verbose = True
        elif a in ("--noverbose", "-noverbose"):
            verbose = False
        elif a.lstrip("-").startswith("verbose="):
            verbose = a.split("=", 1)[1].lower() in ("1", "true", "yes")
    return verbose


def run(argv=None):
    """The `jax-tinybert` entry point."""
    if argv is None:   # a caller that imported this module first: restart now, if at all
        malloc.restart_command()
    argv = list(sys.argv if argv is None else argv)
    if any(a in HELP_ARGS for a in argv[1:]):
        prog = ("python -m jax_tinybert.main" if argv[0].endswith(("main.py", "-m"))
                else os.path.basename(argv[0]) or "jax-tinybert")
        sys.stdout.write(cli_help.text(prog))
        sys.exit(0)
    try:
        app.run(main, argv=argv, flags_parser=_parse_flags)
    except SystemExit as e:
        if e.code in (None, 0):
            _exit_finished()
        raise
    except Exception as e:
        if isinstance(e, UserError):
            message = one_line(e)
        elif is_disk_full(e):
            # Out of disk outside a checkpoint save (the teacher cache, the export, the
            # metrics): the environment's, not a bug; files are written to temporaries and
            # renamed, so nothing half-written is kept.
            message = (f"no space left on the device ({one_line(e)[:300]}); free space there "
                       "or move the workdir (or the cache folder) to a larger disk, then rerun "
                       "the same command: it resumes from the last checkpoint")
        else:
            raise
        if _wants_verbose(argv):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (set-up, the teacher cache build, compiling,
        # evaluating, exporting) or a second one inside it; the loop's first one saves its step
        # and exits 130 through Preempted. Nothing half-written is kept: the caches and
        # checkpoints are written to temporary files and renamed.
        if _wants_verbose(argv):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.write("interrupted (Ctrl-C); rerun the same command to resume from the "
                         "last checkpoint, or start over where there is none\n")
        sys.stderr.flush()
        sys.exit(preemption.exit_code(signal.SIGINT))


def _exit_finished() -> None:
    """Ends a process whose command finished without the interpreter's teardown: its objects
    freed one by one took ~0.3 s of an MRPC stage's exit (benchmarks/RESULTS.md#start-up-exit-checkpoints-and-preemption);
    the kernel frees the memory at once. The atexit handlers run and the output is flushed
    first, as at a normal exit. Only in one process, and only when no other non-daemon thread
    runs (the interpreter would wait for it): otherwise the normal exit."""
    import atexit
    import threading

    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    # CPython's own call for the handlers (private, in every CPython 3); elsewhere the normal
    # exit runs them.
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if others or jax.process_count() != 1 or run_handlers is None:
        return
    run_handlers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run()
