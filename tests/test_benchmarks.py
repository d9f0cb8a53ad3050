"""The benchmarks cannot rot: the PyTorch reference computes our losses, and the throughput
script runs end to end in smoke mode. (Benchmarks are never timed here beyond a sanity bound.)"""
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import step_throughput as st  # noqa: E402
from torch_reference import TorchReference  # noqa: E402

REL = 1e-4


def _losses(stage, tcfg, tparams, scfg, batch):
    sparams = st._random_params(scfg, 2)
    case = st.Case(stage, tcfg, tparams, scfg, sparams, student_dropout=False)
    loss_j, terms_j = jax.jit(case.loss_fn)(
        {"student": case.student_params if stage != "finetune" else tparams, "proj": case.proj},
        case.teacher_params, case.shard(batch), jax.random.PRNGKey(0))
    ref = TorchReference.from_objective(case.obj, case.scfg,
                                        case.student_params if stage != "finetune" else tparams,
                                        case.tcfg, case.host_teacher_params,
                                        jax.device_get(case.proj), student_dropout=False)
    loss_t, terms_t = ref.loss(batch)
    return float(loss_j), {k: float(v) for k, v in terms_j.items()}, float(loss_t.detach()), \
        {k: float(v.detach()) for k, v in terms_t.items()}


def _check(loss_j, terms_j, loss_t, terms_t):
    assert np.isfinite(loss_j) and loss_j > 0
    assert abs(loss_j - loss_t) <= REL * abs(loss_j), (loss_j, loss_t)
    # Terms: the same relative bound plus an absolute floor of 1e-5 for terms that are tiny
    # differences of O(1) float32 numbers (e.g. PKD's KL at T = 10, ~3e-3 after the T^2 factor).
    for k, v in terms_t.items():
        if k in terms_j:
            assert abs(terms_j[k] - v) <= REL * abs(terms_j[k]) + 1e-5, (k, terms_j[k], v)


@pytest.fixture(scope="module")
def tiny_teacher():
    return st.load_teacher("minilm", smoke=True)


@pytest.mark.parametrize("stage", st.STAGES)
@pytest.mark.parametrize("student", ["tinybert4", "l3_d384"])
def test_torch_reference_losses_match_tiny(stage, student, tiny_teacher):
    tcfg, tparams = tiny_teacher
    if stage == "finetune" and student != "tinybert4":
        pytest.skip("finetune trains the teacher itself")
    scfg = st.student_config(student, tcfg, smoke=True)
    batch = st.make_batch(tcfg, 4, 16, seed=3)
    _check(*_losses(stage, tcfg, tparams, scfg, batch))


@pytest.fixture(scope="module")
def minilm(teacher_dir):
    from jax_tinybert.hf import load_pretrained

    return load_pretrained(teacher_dir, for_classification=True)


@pytest.mark.parametrize("stage,student", [("tinybert_intermediate", "tinybert4"),
                                           ("pkd", "tinybert4"), ("pkd", "l3_d384")])
def test_torch_reference_losses_match_minilm(stage, student, minilm):
    """The real teacher (MiniLM-L6-H384) and the benchmark's student shapes, at a short length:
    explicit 4 -> 6 layer maps, the shared projection, 12 heads."""
    tcfg, tparams = minilm
    scfg = st.student_config(student, tcfg)
    batch = st.make_batch(tcfg, 4, 24, seed=5)
    _check(*_losses(stage, tcfg, tparams, scfg, batch))


def test_step_throughput_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k != "JTB_BENCH_REEXEC"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(BENCH / "step_throughput.py"), "--smoke",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    # The script re-executed itself with the glibc malloc settings.
    assert res["machine"]["malloc_env"] == st.MALLOC_ENV
    assert [r["stage"] for r in res["results"]] == list(st.STAGES)
    for r in res["results"]:
        for k in ("s_per_step", "examples_per_s", "gflop_per_s", "torch_s_per_step",
                  "jax_over_torch", "compile_s"):
            assert np.isfinite(r[k]) and r[k] > 0, (r["stage"], k, r[k])
        assert np.isfinite(r["loss"])
    assert res["matmul_peak"]["jax_flop_s"] > 0
    # A generous bound: the smoke run takes seconds on an idle 2-core machine; other jobs
    # running in parallel (e.g. pytest -n) slow it down.
    load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    assert elapsed < 60 * max(1.0, load), f"smoke run took {elapsed:.0f}s (load {load:.1f}/core)"
