"""Checkpoint digests (jax_tinybert/train/digests.py) on a gs:// workdir against the GCS emulator
(tests/helpers/gcs_emulator.py), and the version-1 format on a disk and in a bucket.

On a bucket the digests are the store's CRC32C, from one listing: a save and a restore download
no object of the step but digests.json (counted at gcsfs's HTTP layer); an object overwritten
with other bytes of the same size is still caught. Version-1 digests (SHA-256 of every file,
written before) are still checked. Two processes on a bucket: process 0 alone checks, both
restore the same step.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from helpers import gcs_emulator
from helpers import tiny_run as T
from test_checkpoints import (REPO, SUB_TIMEOUT, _STATE_CODE, _big_state,
                              assert_tree_equal)

from jax_tinybert import fs
from jax_tinybert.train import digests
from jax_tinybert.train.checkpoints import Checkpointer, abstract_like

pytestmark = pytest.mark.skipif(gcs_emulator.available() is not None,
                                reason=str(gcs_emulator.available()))


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator.running() as emu:
        yield emu


@pytest.fixture
def root(emulator):
    return f"gs://{emulator.bucket}/t-{uuid.uuid4().hex[:8]}"


def _get(url) -> bytes:
    fsys, p = fs.url_fs(url)
    return fsys.cat_file(p)


def _put(url, data: bytes) -> None:
    fsys, p = fs.url_fs(url)
    fsys.pipe_file(p, data)


def _sizes(step_url) -> dict:
    """{relative name: bytes} of the objects under `step_url`, listed by the test itself."""
    fsys, p = fs.url_fs(step_url)
    return {k[len(p) + 1:]: v["size"] for k, v in fsys.find(p, detail=True).items()}


def _overwrite_largest(step_url, n=4096) -> str:
    """n bytes in the middle of the step's largest object replaced by others: same size."""
    sizes = {k: v for k, v in _sizes(step_url).items() if k.startswith("state/")}
    name = max(sizes, key=sizes.get)
    data = bytearray(_get(f"{step_url}/{name}"))
    k = len(data) // 2
    data[k:k + n] = bytes(255 - b for b in data[k:k + n])
    _put(f"{step_url}/{name}", bytes(data))
    assert _sizes(step_url)[name] == sizes[name]
    return name


def _save(wd, steps):
    states = {s: _big_state(s) for s in steps}
    with Checkpointer(wd, save_interval_steps=1) as c:
        for s in steps:
            c.save(s, states[s], {"s": s})
    return states


def test_the_emulator_reports_crc32c_as_gcs_does(root):
    """GCS's crc32c: base64 of the big-endian CRC32C (Castagnoli); 0xE3069283 is the
    check value of b"123456789" (RFC 3720, B.4)."""
    import google_crc32c

    _put(f"{root}/check", b"123456789")
    blob = np.random.default_rng(0).bytes(300_000)
    _put(f"{root}/blob", blob)
    fsys, p = fs.url_fs(root)
    assert fsys.info(f"{p}/check")["crc32c"] == base64.b64encode(bytes.fromhex("e3069283")).decode()
    want = base64.b64encode(google_crc32c.value(blob).to_bytes(4, "big")).decode()
    assert fsys.info(f"{p}/blob")["crc32c"] == want


def test_bucket_save_and_restore_download_nothing_of_the_step(root):
    wd = f"{root}/run"
    with gcs_emulator.counting() as saving:
        states = _save(wd, (1, 2))
    step_url = f"{wd}/checkpoints/2"
    doc = json.loads(_get(f"{step_url}/digests.json"))
    assert doc["version"] == digests.VERSION
    listed = {k: v for k, v in _sizes(step_url).items()
              if k not in ("digests.json", "commit_success.txt", "_CHECKPOINT_METADATA")
              and not k.endswith("/commit_success.txt")}
    assert set(doc["files"]) == set(listed)
    assert all(set(w) == {"bytes", "crc32c"} and w["bytes"] == listed[r]
               for r, w in doc["files"].items()), doc
    data = [r for r in listed if "/d/" in r]
    assert data and sum(listed[r] for r in data) > 500_000
    # What gcsfs downloaded while saving is orbax's own small metadata, no array data.
    assert not [n for n in saving.names() if "/d/" in n], saving.reads
    assert saving.bytes_read < 30_000, saving.reads

    c = Checkpointer(wd, save_interval_steps=1)
    with gcs_emulator.counting() as restoring:
        step, got, meta = c.restore_latest(abstract_like(states[2]))
    c.close()
    assert step == 2 and meta == {"s": 2}
    assert_tree_equal(got, states[2])
    assert not [n for n in restoring.names() if "/d/" in n], restoring.reads
    assert restoring.names().count(f"{step_url.split('/', 3)[3]}/digests.json") == 1, restoring.reads

    # The SHA-256 path (the format before, and what a store without checksums gets): every
    # object of the step is downloaded to check it.
    digests.write(step_url, algorithm="sha256")
    with gcs_emulator.counting() as old:
        assert digests.verify(step_url) is None
    assert old.bytes_read >= sum(listed.values())


def test_bucket_object_overwritten_with_same_size_is_caught(root, caplog):
    wd = f"{root}/run"
    states = _save(wd, (1, 2, 3))
    name = _overwrite_largest(f"{wd}/checkpoints/3")
    c = Checkpointer(wd, save_interval_steps=1)
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.train.checkpoints"):
        step, got, meta = c.restore_latest(abstract_like(states[3]))
    assert step == 2 and meta == {"s": 2}
    assert_tree_equal(got, states[2])
    msgs = [r.getMessage() for r in caplog.records]
    assert any("step 3" in m and "fail their crc32c" in m and name in m for m in msgs), msgs
    objs = gcs_emulator.objects(f"{wd}/checkpoints")
    assert any(o.startswith("corrupt_3/") for o in objs) and c.all_steps() == [1, 2]
    with pytest.raises(ValueError, match="damaged"):
        _overwrite_largest(f"{wd}/checkpoints/1")
        c.restore(1, abstract_like(states[1]))
    c.close()


def _write_version_1(step_dir, rels, read) -> None:
    """digests.json as the version before wrote it: SHA-256 of each file, hashed here."""
    files = {r: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
             for r in rels for b in [read(r)]}
    with fs.open_file(fs.join(step_dir, "digests.json"), "w") as fh:
        json.dump({"version": 1, "algorithm": "sha256", "files": files}, fh)


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_version_1_digests_are_still_checked(where, tmp_path, root, caplog):
    wd = str(tmp_path) if where == "disk" else f"{root}/run"
    states = _save(wd, (1, 2))
    for s in (1, 2):
        step_dir = fs.join(wd, "checkpoints", str(s))
        with fs.open_file(fs.join(step_dir, "digests.json")) as fh:
            rels = list(json.load(fh)["files"])

        def read(r, step_dir=step_dir):
            with fs.open_file(fs.join(step_dir, *r.split("/")), "rb") as fh:
                return fh.read()
        _write_version_1(step_dir, rels, read)
    assert digests.verify(fs.join(wd, "checkpoints", "2")) is None
    step2 = fs.join(wd, "checkpoints", "2")
    if where == "disk":
        big = max((os.path.join(r, f) for r, _, fs_ in os.walk(step2) for f in fs_),
                  key=os.path.getsize)
        data = bytearray(open(big, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(big, "wb").write(bytes(data))
    else:
        _overwrite_largest(step2)
    c = Checkpointer(wd, save_interval_steps=1)
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.train.checkpoints"):
        step, got, _ = c.restore_latest(abstract_like(states[2]))
    c.close()
    assert step == 1
    assert_tree_equal(got, states[1])
    assert any("step 2" in m and "fail their sha256" in m
               for m in (r.getMessage() for r in caplog.records))


def test_a_bucket_step_copied_to_a_disk_checks_its_crc32c(root, tmp_path):
    wd = f"{root}/run"
    _save(wd, (1,))
    fsys, p = fs.url_fs(f"{wd}/checkpoints/1")
    local = tmp_path / "1"
    fsys.get(p, str(local), recursive=True)
    assert digests.verify(local) is None
    f = max((q for q in local.rglob("*") if q.is_file()), key=lambda q: q.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert "fail their crc32c" in digests.verify(local)


_TWO_PROCESSES = _STATE_CODE + """
import json, sys
port, pid, wd = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jax.sharding import Mesh
import gcs_emulator
gcs_emulator.use_in_process(dict(__import__("os").environ))
from jax_tinybert import fs
from jax_tinybert.train.checkpoints import Checkpointer, abstract_like
st, tx = sharded_state(Mesh(np.array(jax.devices()), ("data",)))

@jax.jit
def step_fn(st):   # as test_checkpoints' 2-process test: every leaf a global array
    upd, opt = tx.update(jax.tree.map(jnp.ones_like, st.params), st.opt_state, st.params)
    return st.replace(step=st.step + 1, params=optax.apply_updates(st.params, upd), opt_state=opt)

c = Checkpointer(wd, save_interval_steps=1)
for s in (1, 2):
    st = step_fn(st)
    c.save(s, st, {"s": s})
c.wait()
multihost_utils.sync_global_devices("saved")
if pid == 0:     # another byte in the middle of step 2's largest object: same size
    fsys, p = fs.url_fs(wd + "/checkpoints/2/state")
    found = fsys.find(p, detail=True)
    name = max(found, key=lambda k: found[k]["size"])
    data = bytearray(fsys.cat_file(name))
    data[len(data) // 2] ^= 0xFF
    fsys.pipe_file(name, bytes(data))
multihost_utils.sync_global_devices("damaged")
with gcs_emulator.counting() as seen:
    step, got, meta = c.restore_latest(abstract_like(st))
c.close()
print("RESULT " + json.dumps(dict(step=step, meta=meta, digest_reads=sum(
    n.endswith("/digests.json") for n in seen.names()), steps=c.all_steps())), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_on_a_bucket_process_0_checks_both_restore_one_step(emulator, root):
    port = T.free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(emulator.env, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [str(REPO), str(REPO / "tests" / "helpers"), env.get("PYTHONPATH", "")]))
    results = T.run_scripts(_TWO_PROCESSES, [(port, i, f"{root}/run") for i in range(2)], env,
                            SUB_TIMEOUT)
    r0, r1 = results
    for r in results:
        assert r["step"] == 1 and r["meta"] == {"s": 1} and r["steps"] == [1], r
    # Step 2 (damaged) and step 1: process 0 read each one's digests.json, process 1 none.
    assert (r0["digest_reads"], r1["digest_reads"]) == (2, 0), (r0, r1)
    assert any(o.startswith("corrupt_2/") for o in gcs_emulator.objects(f"{root}/run/checkpoints"))


def test_the_benchmark_runs_and_records(tmp_path):
    """benchmarks/checkpoint_digests.py end to end on a small state (wiring, not speed)."""
    env = dict(os.environ, JTB_RESULTS_DIR=str(tmp_path), JTB_MACHINE_KIND="cpu-test",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "checkpoint_digests.py"),
                        "--models", "tinybert4", "--scale", "0.05", "--repeats", "1",
                        "--record"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=SUB_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = json.loads((tmp_path / "checkpoint_digests-cpu-test.json").read_text())
    before, now = kept["rows"]
    assert "before" in before["path"] and "now" in now["path"]
    assert before["restore_MB_read"] > 0.5 * before["state_MB"] > 10
    assert now["save_MB_read"] < 0.1 and now["restore_MB_read"] < 0.1, now
