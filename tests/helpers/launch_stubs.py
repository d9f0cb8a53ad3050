"""Stand-ins for `gcloud`, `uv`, `curl` (TPU VMs) and `srun`, `scontrol` (SLURM), for the
launcher tests in tests/test_launch.py. They record every call and play a small cloud:

- the TPU VM (or queued resource) is a folder: `create` makes it (state READY, or for a queued
  resource WAITING_FOR_RESOURCES on the first describe, then ACTIVE), `delete` kills every
  process started on it and removes it, `describe --format=value(state...)` prints the state or
  fails with NOT_FOUND; `ssh --worker=all --command=CMD` runs CMD under bash once per worker
  (HOME = that worker's folder, STUB_WORKER = its number; each in its own process group), `scp`
  copies into every worker's folder;
- `gcloud stub-preempt` preempts the VM as GCE does: SIGTERM to every process on it, up to 20 s
  for them to end (ssh refused meanwhile), SIGKILL to what is left, then state PREEMPTED
  (SUSPENDED for a queued resource);
- `gcloud storage ls/cp` work on gs:// URLs mapped to folders under FAKE_GCS;
- `uv venv DIR` makes DIR/bin/python a fake interpreter that runs `-m jax_tinybert.main ARGS` as
  FAKE_TRAIN ARGS, and `curl ...agent-worker-number` answers STUB_WORKER.

The fake trainer (FAKE_TRAIN_SH) reads one word per start from STUB_DIR/plan (counted per worker):
preempt (worker 0 preempts the VM; on SIGTERM each worker "saves" step 3 and exits 143), done
(worker 0 writes <workdir>/summary.json; exit 0), crash (exit 1), usererror (exit 2).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import stat
import sys

GCLOUD = r'''
import json, os, shutil, signal, subprocess, sys, time
D = os.environ["STUB_DIR"]
GCS = os.environ["FAKE_GCS"]
N = int(os.environ.get("STUB_WORKERS", "1"))
VM = os.path.join(D, "vm")
argv = sys.argv[1:]
if argv[:1] != ["stub-preempt-now"]:
    with open(os.path.join(D, "calls.jsonl"), "a") as f:
        f.write(json.dumps(argv) + "\n")


def fail(msg, rc=1):
    sys.stderr.write(msg + "\n")
    sys.exit(rc)


def gs(url):
    return os.path.join(GCS, url[len("gs://"):]) if url.startswith("gs://") else url


def read(name, default=None):
    try:
        with open(os.path.join(VM, name)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return default


def write(name, text):
    with open(os.path.join(VM, name), "w") as f:
        f.write(text)


def alive(pgid):
    for st in os.listdir("/proc"):
        if st.isdigit():
            try:
                fields = open(f"/proc/{st}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def groups():
    try:
        return [int(x) for x in open(os.path.join(D, "pgids")).read().split()]
    except FileNotFoundError:
        return []


def kill_all(sig):
    for g in groups():
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


def preempt():
    time.sleep(0.3)
    kill_all(signal.SIGTERM)
    t0 = time.time()
    while any(alive(g) for g in groups()) and time.time() - t0 < 20:
        time.sleep(0.05)
    kill_all(signal.SIGKILL)
    write("state", "SUSPENDED" if read("kind") == "qr" else "PREEMPTED")
    os.remove(os.path.join(VM, "preempting"))


pos = [a for a in argv if not a.startswith("-")]
if argv[:2] == ["storage", "ls"]:
    url = pos[2]
    p = gs(url)
    if url.endswith("/") and os.path.isdir(p):
        for name in sorted(os.listdir(p)):
            print(url + name)
    elif os.path.isfile(p):
        print(url)
    else:
        fail("ERROR: (gcloud.storage.ls) One or more URLs matched no objects.")
elif argv[:2] == ["storage", "cp"]:
    src, dst = gs(pos[2]), gs(pos[3])
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(src, dst + ".part")
    os.replace(dst + ".part", dst)
elif argv[:1] == ["stub-preempt"]:
    write("preempting", "1")
    subprocess.Popen([sys.executable, __file__, "stub-preempt-now"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
elif argv[:1] == ["stub-preempt-now"]:
    preempt()
elif argv[:3] == ["compute", "tpus", "tpu-vm"] or argv[:3] == ["compute", "tpus", "queued-resources"]:
    kind = "qr" if argv[2] == "queued-resources" else "vm"
    verb, name = argv[3], pos[4] if len(pos) > 4 else ""
    state = read("state")
    if verb == "describe":
        if state is None:
            fail(f"ERROR: (gcloud.compute.tpus.{argv[2]}.describe) NOT_FOUND: Resource "
                 f"'projects/p/locations/z/{argv[2]}/{name}' was not found")
        if state == "WAITING_FOR_RESOURCES":
            write("state", "ACTIVE")
        print(state)
    elif verb == "create":
        if state is not None:
            fail(f"ERROR: (gcloud.compute.tpus.{argv[2]}.create) ALREADY_EXISTS: {name}")
        os.makedirs(VM)
        write("kind", kind)
        write("state", "WAITING_FOR_RESOURCES" if kind == "qr" else "READY")
        for i in range(N):
            os.makedirs(os.path.join(VM, f"worker-{i}"))
    elif verb == "delete":
        if state is None:
            fail(f"ERROR: (gcloud.compute.tpus.{argv[2]}.delete) NOT_FOUND: {name}")
        while os.path.exists(os.path.join(VM, "preempting")):
            time.sleep(0.05)
        kill_all(signal.SIGKILL)
        shutil.rmtree(VM)
    elif verb in ("ssh", "scp"):
        if state not in ("READY", "ACTIVE") or read("preempting"):
            fail("ssh: connect to host 10.0.0.2 port 22: Connection refused", 255)
        worker = next(a.split("=", 1)[1] for a in argv if a.startswith("--worker="))
        workers = range(N) if worker == "all" else [int(worker)]
        if verb == "scp":
            src, dst = pos[4], pos[5].split(":", 1)[1]
            for i in workers:
                shutil.copytree(src, os.path.join(VM, f"worker-{i}", dst), dirs_exist_ok=True)
            sys.exit(0)
        cmd = next(a.split("=", 1)[1] for a in argv if a.startswith("--command="))
        procs = []
        for i in workers:
            home = os.path.join(VM, f"worker-{i}")
            env = dict(os.environ, HOME=home, STUB_WORKER=str(i))
            p = subprocess.Popen(["bash", "-c", cmd], cwd=home, env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            with open(os.path.join(D, "pgids"), "a") as f:
                f.write(f"{p.pid}\n")
            procs.append(p)
        rc = 0
        for p in procs:
            sys.stdout.write(p.communicate()[0])
            rc = max(rc, p.returncode)
        sys.exit(rc)
    else:
        fail(f"stub gcloud: unexpected {argv}", 3)
else:
    fail(f"stub gcloud: unexpected {argv}", 3)
'''

UV_SH = r'''#!/usr/bin/env bash
echo "uv $*" >> "$STUB_DIR/uv.log"
if [ "$1" = venv ]; then
  dir="${*: -1}"; mkdir -p "$dir/bin"; cp "$STUB_DIR/fake_python" "$dir/bin/python"; chmod +x "$dir/bin/python"
fi
'''

CURL_SH = r'''#!/usr/bin/env bash
case "$*" in *agent-worker-number*) echo "$STUB_WORKER" ;; *) exit 22 ;; esac
'''

FAKE_PYTHON_SH = r'''#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "jax (stub) ok"; exit 0; fi
if [ "$1 $2" = "-m jax_tinybert.main" ]; then shift 2; exec "$FAKE_TRAIN" "$@"; fi
echo "stub python: unexpected $*" >&2; exit 3
'''

FAKE_TRAIN_SH = r'''#!/usr/bin/env bash
w="$STUB_WORKER"
n=$(( $(cat "$STUB_DIR/starts-$w" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$STUB_DIR/starts-$w"
printf '%s\n' "$@" > "$STUB_DIR/argv-$n-$w"
mode=$(sed -n "${n}p" "$STUB_DIR/plan")
wd=""; for a in "$@"; do case "$a" in --workdir=*) wd="${a#--workdir=}" ;; esac; done
local_wd="$FAKE_GCS/${wd#gs://}"
if [ -d "$local_wd/checkpoints" ]; then echo "resumed from step $(ls "$local_wd/checkpoints" | sort -n | tail -1)"; fi
echo "worker $w, start $n: $mode"
case "$mode" in
  preempt)
    trap 'mkdir -p "$local_wd/checkpoints/3"; echo "preempted: saved step 3 in $wd; rerun the same command to resume"; exit 143' TERM
    echo "step 3/6"
    if [ "$w" = 0 ]; then gcloud stub-preempt; fi
    while :; do sleep 0.1; done ;;
  done)
    echo "step 6/6"
    if [ "$w" = 0 ]; then mkdir -p "$local_wd"; echo '{"steps": 6}' > "$local_wd/summary.json"; fi
    exit 0 ;;
  crash) echo "Traceback (most recent call last): boom"; exit 1 ;;
  usererror) echo "error: --config.train.num_steps=-1 must be positive; pass a number > 0"; exit 2 ;;
  *) echo "fake train: no plan for start $n" >&2; exit 3 ;;
esac
'''


def _write(path: pathlib.Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def tpu_cloud(tmp_path: pathlib.Path, plan, workers: int = 2):
    """(env additions, stub dir, fake-GCS dir) for running launch/tpu_vm.sh against the stubs;
    `plan`: the fake trainer's mode for each start."""
    stub, gcs, bin_dir = tmp_path / "stub", tmp_path / "gcs", tmp_path / "bin"
    for d in (stub, gcs, bin_dir):
        d.mkdir(parents=True)
    _write(bin_dir / "gcloud", f"#!{sys.executable}\n{GCLOUD}")
    _write(bin_dir / "uv", UV_SH)
    _write(bin_dir / "curl", CURL_SH)
    _write(stub / "fake_python", FAKE_PYTHON_SH)
    _write(stub / "fake_train", FAKE_TRAIN_SH)
    (stub / "plan").write_text("".join(f"{m}\n" for m in plan))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_DIR": str(stub),
           "FAKE_GCS": str(gcs), "STUB_WORKERS": str(workers), "FAKE_TRAIN": str(stub / "fake_train")}
    return env, stub, gcs


def calls(stub: pathlib.Path):
    """Every recorded gcloud call, as argv lists."""
    path = stub / "calls.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def kill_leftovers(stub: pathlib.Path) -> None:
    """SIGKILL every process group the stub started (a failed test must not leave any)."""
    path = stub / "pgids"
    for g in (path.read_text().split() if path.exists() else []):
        try:
            os.killpg(int(g), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


SRUN_SH = r'''#!/usr/bin/env bash
# srun's options are recorded and dropped; the command runs in srun's place (exec), so a signal
# sent to "srun" reaches it, as srun forwards SIGTERM to its tasks.
printf '%s\n' "$*" >> "$STUB_DIR/srun.log"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
# A one-task step, as srun describes it to its task (what JAX's SLURM detection reads).
export SLURM_STEP_NODELIST="$(hostname)" SLURM_NTASKS=1 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0
exec "$@"
'''

SCONTROL_SH = r'''#!/usr/bin/env bash
printf '%s\n' "$*" >> "$STUB_DIR/scontrol.log"
'''


def slurm_cluster(tmp_path: pathlib.Path):
    """(env additions, stub dir) for running launch/slurm.sbatch under bash with stub srun and
    scontrol (each records its calls in <stub>/srun.log, <stub>/scontrol.log)."""
    stub, bin_dir = tmp_path / "slurm_stub", tmp_path / "slurm_bin"
    stub.mkdir(parents=True)
    bin_dir.mkdir(parents=True)
    _write(bin_dir / "srun", SRUN_SH)
    _write(bin_dir / "scontrol", SCONTROL_SH)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_DIR": str(stub)}, stub
