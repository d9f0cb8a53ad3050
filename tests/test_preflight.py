"""`--check`: the run's config on a few batches, one line per host, exit 0; a stage it cannot
check is one line, exit 2. Several processes: tests/test_pod.py."""
from __future__ import annotations

import subprocess

from helpers import tiny_run as T

REPO = T.REPO


def _check(tmp_path, shared_dir, *extra, env=None):
    teacher = T.tiny_teacher(tmp_path / "teacher")
    return subprocess.run(
        [T.PYTHON, "-m", "jax_tinybert.main", "--config=configs/finetune_teacher.py:sst2",
         f"--workdir={tmp_path / 'wd'}", f"--config.teacher.path={teacher}",
         f"--config.data.glue_dir={shared_dir / 'data' / 'glue'}", "--check", *extra],
        env=env or T.env(), cwd=REPO, capture_output=True, text=True, timeout=300)


def test_check_runs_the_config_on_a_few_batches_and_leaves_nothing_of_its_run(tmp_path,
                                                                               shared_dir):
    res = _check(tmp_path, shared_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "resumed from step 1" in out                  # the restore ran
    assert "[check] 1 process(es), 1 device(s), mesh {'data': 1, 'fsdp': 1, 'model': 1}" in out
    assert "[check] process 0: 1 local device(s) [0], batch slices [0], 32 train rows a step" in out
    assert "eval (acc=" in out and "[check] passed" in out
    # the check's own run is gone; what stays is at most the tokenised data, for the real run
    assert {p.name for p in (tmp_path / "wd").iterdir()} <= {"cache"}


def test_check_with_a_batch_the_mesh_cannot_split_fails_as_the_run_would(tmp_path, shared_dir):
    res = _check(tmp_path, shared_dir, "--config.train.batch_size=3", env=T.env(JTB_CPU_DEVICES=2))
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith(
        "error: config.train.batch_size=3 cannot be split over the mesh"), res.stderr[-2000:]
    assert "the smallest valid global batch is 2" in res.stderr


def test_check_refuses_the_demo_in_one_line(tmp_path):
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", "--config=configs/demo.py",
                          f"--workdir={tmp_path / 'wd'}", "--check"], env=T.env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: --check runs one training stage")
    assert not (tmp_path / "wd").exists()
