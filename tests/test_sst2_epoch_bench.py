"""Smoke run of benchmarks/sst2_epoch.py so it cannot rot (not a timed test)."""
import json
import os
import subprocess
import sys


def test_sst2_epoch_smoke(tmp_path, glue_dir, repo_dir):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "benchmarks/sst2_epoch.py", "--smoke",
                        f"--glue_dir={glue_dir}", f"--json={out}"], cwd=repo_dir,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["examples"] == 256
    # Bucketed batches never outnumber fixed-length ones (at most one partial batch per bucket).
    assert 1 <= sum(res["steps_per_bucket"].values()) <= res["steps_fixed_64"]
    assert res["ours_epoch_s"] > 0 and res["official_way_jax_epoch_s"] > 0
