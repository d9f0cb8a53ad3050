"""Per-host views of the train steps (jax_tinybert/train/hosts.py): the jax.profiler trace of
config.train.profile_start / profile_steps in <workdir>/profile/host<i>, and the straggler line
(each host's step time and input wait; the host whose input wait is over 1.2x the median
named), with 2 processes where one is made slow in its input iterator only
(tests/helpers/multihost_main.py JTB_TEST_SLOW_INPUT)."""
from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess

import numpy as np
import pytest

from helpers import tiny_run as T
from jax_tinybert.train import hosts

REPO = T.REPO


def _trace_steps(workdir, host=0):
    """The step numbers of the 'train' step markers in the one trace of <workdir>/profile."""
    traces = glob.glob(os.path.join(workdir, "profile", f"host{host}", "plugins", "profile",
                                    "*", "*.trace.json.gz"))
    assert len(traces) == 1, traces
    with gzip.open(traces[0]) as fh:
        events = json.load(fh)["traceEvents"]
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")


@pytest.mark.timeout(300)
def test_the_trace_holds_the_named_steps_only(tmp_path_factory, tmp_path):
    teacher, cache = T.shared_dirs(tmp_path_factory)
    wd = tmp_path / "wd"
    args = T.train_args(wd, teacher, steps=8, checkpoint_every=4, extra=(
        "--config.train.profile_start=3", "--config.train.profile_steps=2"))
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args],
                         env=T.env(**T.cache_env(cache)), cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _trace_steps(wd) == [3, 4]
    assert glob.glob(str(wd / "profile" / "host0" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert sorted(os.listdir(wd / "profile")) == ["host0"]   # no temporary left beside it
    assert "profile of train steps 3-4 (jax.profiler)" in res.stderr
    # Rerun when finished: no step runs, the trace stays as it was.
    before = sorted(glob.glob(str(wd / "profile" / "**"), recursive=True))
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args],
                         env=T.env(**T.cache_env(cache)), cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(glob.glob(str(wd / "profile" / "**"), recursive=True)) == before


def test_profile_fields_are_checked_and_may_change_on_resume():
    from helpers.run_files import config
    from jax_tinybert.config import check
    from jax_tinybert.train import build

    assert {"train.profile_start", "train.profile_steps"} <= check.NO_RESULT_CHANGE
    cfg = build.with_defaults(config("task_distill.py", "sst2_intermediate"))
    cfg.train.profile_steps = 0
    with pytest.raises(check.ConfigValueError, match=r"config.train.profile_steps=0 must be >= 1"):
        check.validate_config(cfg, paths=False)
    cfg.train.profile_steps, cfg.train.profile_start = 5, -1
    with pytest.raises(check.ConfigValueError, match=r"profile_start=-1 must be >= 0"):
        check.validate_config(cfg, paths=False)


def test_the_straggler_line_names_the_host_that_waits_for_its_input():
    rows = np.array([[0.30, 0.002], [0.30, 0.001], [0.31, 0.25], [0.30, 0.003]])
    line = hosts.straggler_line(40, rows)
    assert line.startswith("[hosts] step 40: s/step by host 0.300 0.300 0.310 0.300; "
                           "input wait s/step 0.002 0.001 0.250 0.003"), line
    # The median of the waits is 0.0025: host 2 waits 100x that.
    assert "straggler: host 2 waits 0.250 s a step for its input, 100.0x the median" in line
    # Even hosts, and waits over 1.2x the median but a negligible share of a step: no one named.
    assert "straggler" not in hosts.straggler_line(1, np.array([[0.3, 0.01], [0.3, 0.011]]))
    assert "straggler" not in hosts.straggler_line(1, np.array([[0.3, 1e-4], [0.3, 1e-3]]))
    # Many hosts: median and max, not every value.
    many = np.tile([[0.3, 0.001]], (16, 1))
    many[9, 1] = 0.2
    line = hosts.straggler_line(2, many)
    assert "input wait s/step median 0.001, max 0.200 on host 9" in line
    assert "straggler: host 9" in line


def test_one_process_gathers_nothing():
    class Writer:
        def __init__(self):
            self.records = []

        def write(self, step, metrics, prefix=""):
            self.records.append((step, prefix, metrics))

    clock = iter([0.0, 1.0]).__next__
    t = hosts.HostTimes(clock=clock)
    t.waited(0.25)
    w = Writer()
    assert t.record(1, w) is None and w.records == []


@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_the_slow_host_is_named(tmp_path_factory, tmp_path):
    """2 processes x 2 devices; process 1 sleeps 0.15 s in each next() of its batcher."""
    teacher, cache = T.shared_dirs(tmp_path_factory)
    wd = tmp_path / "wd"
    args = T.train_args(wd, teacher, steps=12, checkpoint_every=12, dropout=False,
                        extra=("--config.train.log_every=4",))
    env = T.env(**T.cache_env(cache), JTB_TEST_SLOW_INPUT="1:0.15",
                PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}")
    out = T.run_job(args, env, [tmp_path / f"p{i}.log" for i in range(2)], devices=2)
    lines = [l for l in out[0].splitlines() if l.startswith("[hosts] step ")]
    assert [int(l.split()[2].rstrip(":")) for l in lines] == [1, 4, 8, 12], lines
    assert not any(l.startswith("[hosts]") for l in out[1].splitlines())   # process 0 only
    # After the first record (compilation, the same on both), host 1 is named at every one.
    for l in lines[1:]:
        assert "straggler: host 1 waits 0.1" in l, l
    recs = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines() if l.strip()]
    waits = [(r["hosts/input_wait_s/0"], r["hosts/input_wait_s/1"]) for r in recs
             if "hosts/input_wait_s/1" in r and r["step"] > 1]
    assert len(waits) == 3, recs[-3:]
    for w0, w1 in waits:
        assert w1 >= 0.15 and w0 < 0.05, waits
    steps = [(r["hosts/step_s/0"], r["hosts/step_s/1"]) for r in recs
             if "hosts/step_s/1" in r and r["step"] > 1]
    # Synchronous steps: each host's step takes as long as the slow one's input.
    assert all(min(s) >= 0.15 for s in steps), steps
