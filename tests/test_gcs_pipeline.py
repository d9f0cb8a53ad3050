"""The demo's four stages as one command over a `gs://` workdir (a local GCS emulator, as in
tests/test_gcs_workdir.py): each stage reads the previous one's export from the bucket, the
synthetic corpus is written to and read from the bucket, results.json lands there.

A tiny random teacher and a 1-layer d-16 student, a few steps a stage. The run is preempted
(SIGTERM) during the third stage, after its first checkpoint; the rerun skips the two finished
stages (their objects are not rewritten: same generations, no new checkpoint), resumes the
third from its checkpoint and finishes. In the multihost tier, 2 processes run it and rerun it
with process 1 blind to the stages' summary.json: both skip what process 0 found done.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from helpers import gcs_emulator
from helpers import tiny_run as T

pytestmark = pytest.mark.skipif(gcs_emulator.available() is not None,
                                reason=str(gcs_emulator.available()))
REPO = T.REPO
STEPS = dict(teacher=4, general=4, intermediate=6, pred=4)


def _args(wd, teacher, extra=()):
    return ["--config=configs/demo.py", f"--workdir={wd}", f"--config.teacher.path={teacher}",
            "--config.data.kind=synthetic", "--config.data.synthetic_train=256",
            "--config.data.synthetic_eval=16", "--config.data.max_len=16",
            "--config.data.buckets=(16,)", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
            "--config.student.num_attention_heads=4", "--config.train.batch_size=8",
            "--config.train.checkpoint_every=2", "--config.train.log_every=1",
            *(f"--config.demo_steps.{k}={v}" for k, v in STEPS.items()), *extra]


def _generations(url: str) -> dict:
    """{object name under `url`: its generation} (a rewritten object gets a new one)."""
    from jax_tinybert import fs

    fsys, p = fs.url_fs(url)
    return {name[len(p) + 1:]: str(info.get("generation"))
            for name, info in fsys.find(p, detail=True).items()}


def _read_json(url):
    from jax_tinybert import fs

    with fs.open_file(url) as fh:
        return json.load(fh)


@pytest.mark.timeout(300)
def test_demo_pipeline_in_a_bucket_preempted_in_stage_3_and_resumed(tmp_path_factory, tmp_path):
    teacher = T.tiny_teacher(tmp_path_factory.getbasetemp() / "tiny_teacher_2way", num_labels=2)
    _, cache = T.shared_dirs(tmp_path_factory)
    with gcs_emulator.running() as emu:
        wd = f"gs://{emu.bucket}/runs/demo"
        env = T.env(**T.cache_env(cache), **emu.env, JTB_TEST_STEP_SLEEP="0.2",
                    PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}")
        log = tmp_path / "first.log"
        # Each stage's step 1 traced too (train/hosts.py), into the bucket.
        args = _args(wd, teacher, ("--config.train.profile_start=1",
                                   "--config.train.profile_steps=1"))
        proc = subprocess.Popen([T.PYTHON, "-m", "slow_main", *args], env=env,
                                cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        rc = T.signal_when(
            proc, lambda: "intermediate/checkpoints/2/commit_success.txt" in
            gcs_emulator.objects(wd), signal.SIGTERM, 200, "stage 3's step-2 checkpoint")
        first = log.read_text()
        assert rc == 143, first[-3000:]
        assert T.saved_step(first) < STEPS["intermediate"], first[-2000:]
        names = gcs_emulator.objects(wd)
        assert "corpus/synthetic.txt" in names and "intermediate/summary.json" not in names
        assert "general/export/config.json" in names and "results.json" not in names
        before = {s: _generations(f"{wd}/{s}") for s in ("teacher", "general")}

        res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=200)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-3000:]
        for s in ("teacher", "general"):
            assert out.count(f"[{s}] already done in {wd}/{s}") == 1, out[-3000:]
            assert f"##### stage {wd}/{s}\n" not in out
            # Not trained again: not one object of the stage rewritten, none added.
            assert _generations(f"{wd}/{s}") == before[s], s
        assert f"resumed from step {T.saved_step(first)} in {wd}/intermediate" in out, out[-3000:]
        assert f"##### stage {wd}/pred" in out
        # The later stages read the earlier ones' exports from the bucket.
        assert f"(from {wd}/intermediate/export)" in out, out[-3000:]
        results = _read_json(f"{wd}/results.json")
        for s in ("intermediate", "pred"):
            assert _read_json(f"{wd}/{s}/summary.json")["steps"] == STEPS[s]
        assert results["student"] == _read_json(f"{wd}/pred/summary.json")["best"]
        assert results["teacher"] == _read_json(f"{wd}/teacher/summary.json")["best"]
        assert results["student_params"] < results["teacher_params"]
        names = gcs_emulator.objects(wd)
        assert not any("tmp-" in n for n in names)
        for s in STEPS:
            assert any(n.startswith(f"{s}/profile/host0/plugins/profile/") and
                       n.endswith(".xplane.pb") for n in names), s


def _job(args, env, out_dir, tag, timeout=240):
    """2 processes x 1 CPU device of one job (tests/helpers/multihost_main.py) -> their logs;
    both killed when they outlast `timeout` (processes that disagree on a stage wait forever)."""
    return T.run_job(args, env, [out_dir / f"{tag}_p{i}.log" for i in range(2)], timeout=timeout)


@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_every_process_skips_the_stages_process_0_found_done(tmp_path_factory, tmp_path):
    """2 processes over gs://: the whole demo, then a rerun where process 1 sees no stage's
    summary.json (as a host whose disk lacks another's files): both skip all four stages
    (process 1 on its own would train the first one alone and wait forever for process 0)."""
    teacher = T.tiny_teacher(tmp_path_factory.getbasetemp() / "tiny_teacher_2way", num_labels=2)
    _, cache = T.shared_dirs(tmp_path_factory)
    with gcs_emulator.running() as emu:
        wd = f"gs://{emu.bucket}/runs/demo_mp"
        env = T.env(**T.cache_env(cache), **emu.env,
                    PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}")
        first = _job(_args(wd, teacher), env, tmp_path, "first")
        assert "results.json" in gcs_emulator.objects(wd)
        assert first[0].count("##### stage") == 4 and "already done" not in first[0]
        assert "=== jax-tinybert demo" in first[0] and "=== jax-tinybert demo" not in first[1]
        done = _generations(wd)
        again = _job(_args(wd, teacher), dict(env, JTB_TEST_NO_SUMMARY="1"), tmp_path, "again",
                     timeout=90)
        assert again[0].count("already done") == 4, again[0][-3000:]
        # Only process 0 prints; process 1 trained nothing (no stage of its own).
        assert "already done" not in again[1] and "##### stage" not in again[1]
        assert "=== jax-tinybert demo" not in again[1]
        now = _generations(wd)
        changed = {k for k in done if now.get(k) != done[k]}
        assert changed == {"results.json"}, sorted(changed)[:20]
