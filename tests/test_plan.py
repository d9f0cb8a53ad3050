"""The scale planner (python -m jax_tinybert.cli.plan): its numbers, computed from abstract shapes
only, agree with the real jitted train step built from real arrays on this machine."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import tiny_run

REPO = pathlib.Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "helpers" / "plan_vs_real.py"


def _env(cache=None):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(REPO)
    # Compiling is most of a plan of tiny models: XLA's cheapest backend optimisation, as
    # tests/helpers/tiny_run.py (the planner keeps XLA_FLAGS other than the device count).
    env["XLA_FLAGS"] = tiny_run.FAST_COMPILE_XLA_FLAGS
    if cache:
        # The real step's compile then hits the executable the planner compiled: a cache hit
        # is itself proof that both built the same program (same HLO fingerprint).
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


@pytest.mark.timeout(400)
def test_plan_matches_real_step(tmp_path):
    res = subprocess.run([sys.executable, str(HELPER), "2"], env=_env(tmp_path / "cc"), cwd=REPO,
                         capture_output=True, text=True, timeout=380)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.split("JSON", 1)[1])
    for name, r in out.items():
        p = r["plan"]
        assert p["devices"] == 2
        # Same program: the FLOPs, XLA's argument and temp sizes are identical.
        assert p["flops_per_device"] == pytest.approx(r["real_flops"], rel=1e-9), name
        assert p["flops_per_device"] > 1e6
        assert p["argument_bytes"] == r["real_argument_bytes"], name
        assert p["temp_bytes"] == r["real_temp_bytes"], name
        # What the planner says a device holds = the bytes of the real shards on device 0.
        assert p["held_bytes_per_device"] == r["actual_arg_bytes_dev0"], name
        # XLA's argument size leaves out inputs the step never reads (teacher pooler): close.
        assert abs(p["argument_bytes"] - r["actual_arg_bytes_dev0"]) <= 0.03 * r["actual_arg_bytes_dev0"]
        assert p["peak_bytes_per_device"] >= p["held_bytes_per_device"] + p["temp_bytes"]
        if r["peak_bytes_in_use"]:                     # backends with memory stats (GPU/TPU)
            assert r["peak_bytes_in_use"] <= 1.1 * p["peak_bytes_per_device"]
    # fsdp shards the state and the teacher: about half per device on 2 devices.
    dp, fs = out["dp"]["plan"], out["fsdp"]["plan"]
    assert fs["state_bytes_per_device"] < 0.6 * dp["state_bytes_per_device"]
    assert fs["teacher_bytes_per_device"] < 0.6 * dp["teacher_bytes_per_device"]
    assert out["dp"]["loss"] == pytest.approx(out["fsdp"]["loss"], rel=1e-5)


@pytest.mark.timeout(300)
def test_plan_cli(tmp_path):
    js = tmp_path / "plan.json"
    res = subprocess.run([sys.executable, "-m", "jax_tinybert.cli.plan", "--teacher", "tinybert4",
                          "--student", "tinybert4", "--batch", "8", "--seq_len", "16",
                          "--devices", "4", "--mesh", "fsdp", "--peak_tflops", "100",
                          "--step_time", "0.01", "--json", str(js)], env=_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "| devices | mesh |" in res.stdout and "fsdp=4" in res.stdout
    rows = json.loads(js.read_text())
    assert len(rows) == 1 and rows[0]["devices"] == 4 and rows[0]["mesh"]["fsdp"] == 4
    r = rows[0]
    assert r["required_mfu"] == pytest.approx(r["flops_per_device"] / (0.01 * 100e12))


@pytest.mark.parametrize("argv,msg", [
    (["--teacher", "nope"], "--teacher 'nope': not a preset; use one of bert-base,"),
    (["--objective", "tinybert_foo"], "--objective 'tinybert_foo': use one of tinybert_intermediate"),
    (["--mesh", "data=3", "--devices", "2"],
     "--mesh data=3 --devices 2: config.mesh {'data': 3, 'fsdp': 1, 'model': 1} needs 3 devices"),
    (["--mesh", "data=x"], "--mesh 'data=x': expected dp, fsdp or e.g. data=4,fsdp=2,model=1"),
])
def test_plan_cli_mistakes_are_one_line(argv, msg):
    """Refused before anything compiles, one line, status 2 (they were tracebacks, status 1)."""
    res = subprocess.run([sys.executable, "-m", "jax_tinybert.cli.plan", *argv], env=_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[-1].startswith(f"python -m jax_tinybert.cli.plan: error: {msg}"), lines[-1]
