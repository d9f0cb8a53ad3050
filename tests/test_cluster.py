"""Starting jax.distributed from the cluster JAX itself detects (jax_tinybert/parallel/cluster.py),
with faked environments, offline:

- a Cloud TPU VM pod end to end: a local stand-in for the GCE metadata server answers each of
  2 processes as its worker; each finds the job through JAX's GceTpuCluster and joins it
  (2 processes x 2 CPU devices, gloo), and a collective across them runs;
- a single-host TPU VM and a 1-task SLURM job are left alone;
- GKE TPUs, a SLURM step and an Open MPI job give jax.distributed.initialize what they publish;
- explicit JTB_* flags win over a detected cluster; --cluster=none asks nothing;
- a metadata server that does not answer stops the CLI with one line naming it and the fix.

In-process tests replace jax.distributed.initialize with a recorder.
"""
from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import warnings

import jax
import pytest

from helpers import tiny_run as T
from jax_tinybert.errors import UserError
from jax_tinybert.parallel import cluster, sharding

REPO = T.REPO
HELPERS = REPO / "tests" / "helpers"
# Variables through which a machine could tell JAX it is part of a cluster.
CLUSTER_VARS = ("TPU_", "MEGASCALE_", "SLURM_", "OMPI_", "PMIX_", "PRTE_", "KUBERNETES_",
                "GCE_", "JTB_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS", "JAX_FORCE_TPU_INIT")
TPU_ENV = "ACCELERATOR_TYPE: 'v4-16'\nTYPE: 'V4'\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Metadata(http.server.BaseHTTPRequestHandler):
    """GET /<worker>/computeMetadata/v1/instance/attributes/<key>: that worker's answer, as the
    GCE metadata server gives it (only with the header Metadata-Flavor: Google)."""

    def do_GET(self):
        worker, _, path = self.path.lstrip("/").partition("/")
        prefix = "computeMetadata/v1/instance/attributes/"
        key = path[len(prefix):] if path.startswith(prefix) else None
        self.server.asked.append((worker, key))
        value = self.server.answers.get(worker, {}).get(key)
        code = (403 if self.headers.get("Metadata-Flavor") != "Google"
                else 404 if value is None else 200)
        body = (value if code == 200 else "not found").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/text")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _worker(number, endpoints):
    return {"agent-worker-number": str(number), "worker-network-endpoints": endpoints,
            "tpu-env": TPU_ENV}


@pytest.fixture(scope="module")
def metadata():
    """A metadata server for w0, w1 (a 2-worker pod), single (a 1-host TPU VM) and gke (tpu-env
    only)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    pod = "127.0.0.1,127.0.0.1"
    server.answers = {"w0": _worker(0, pod), "w1": _worker(1, pod),
                      "single": _worker(0, "127.0.0.1"), "gke": {"tpu-env": TPU_ENV}}
    server.asked = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _clean(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(CLUSTER_VARS)}


@pytest.fixture
def calls(monkeypatch):
    """No cluster variable from this machine; jax.distributed.initialize records its arguments."""
    for k in list(os.environ):
        if k.startswith(CLUSTER_VARS):
            monkeypatch.delenv(k)
    got = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: got.append(kw))
    collectives = jax.config.jax_cpu_collectives_implementation
    yield got
    jax.config.update("jax_cpu_collectives_implementation", collectives)


@pytest.fixture
def tpu_vm(monkeypatch):
    """What JAX's start-up records on a Cloud TPU VM (JAX's TPU classes read it at import)."""
    from jax._src.clusters import cloud_tpu_cluster, cluster as jax_cluster

    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(jax_cluster, "running_in_cloud_tpu_vm", True)


@pytest.fixture
def listener():
    """A port that accepts connections, standing in for a running process 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def _setenv(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))


CHILD = """
import json, os
leaked = sorted(k for k in os.environ if k.startswith(("TPU_", "MEGASCALE_")))
import logging
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
logging.getLogger("jax_tinybert").setLevel(logging.INFO)
import tpu_vm_main  # noqa  (as on a TPU VM: jax, then what the CLI imports first)
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
from jax_tinybert.parallel import sharding
started = sharding.maybe_initialize_distributed(timeout_s=60)
ids = multihost_utils.process_allgather(jnp.int32(jax.process_index())).tolist()
print("RESULT", json.dumps(dict(
    started=started, leaked=leaked, index=jax.process_index(), count=jax.process_count(),
    devices=jax.device_count(), local=jax.local_device_count(), ids=ids,
    collectives=jax.config.jax_cpu_collectives_implementation)))
"""


@pytest.mark.timeout(180)
def test_a_cloud_tpu_vm_pod_starts_from_the_metadata_server(metadata):
    port = metadata.server_address[1]
    coordinator_port = _free_port()
    procs = []
    for i in range(2):
        env = _clean(T.env(PYTHONPATH=f"{REPO}{os.pathsep}{HELPERS}"))
        env.update(JAX_FORCE_TPU_INIT="1", JAX_PLATFORMS="cpu", JTB_CPU_DEVICES="2",
                   GCE_METADATA_IP=f"127.0.0.1:{port}/w{i}",
                   JAX_COORDINATOR_PORT=str(coordinator_port))
        procs.append(subprocess.Popen([T.PYTHON, "-c", CHILD], env=env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err[-4000:]
        outs.append((json.loads(out.split("RESULT", 1)[1].splitlines()[0]), err))
    for i, (res, _) in enumerate(outs):
        assert res == dict(started=True, leaked=[], index=i, count=2, devices=4, local=2,
                           ids=[0, 1], collectives="gloo"), res
    # Process 0 says where the job came from, in one line; process 1 says nothing.
    line = ("jax.distributed started from Cloud TPU VM (GCE metadata server): process 0 of 2, "
            f"coordinator 127.0.0.1:{coordinator_port}, 2 local / 4 global devices")
    assert line in outs[0][1] and "jax.distributed started" not in outs[1][1]
    for w in ("w0", "w1"):
        for key in ("agent-worker-number", "worker-network-endpoints", "tpu-env"):
            assert (w, key) in metadata.asked


def test_a_single_host_tpu_vm_is_left_alone(metadata, calls, tpu_vm, monkeypatch, caplog):
    _setenv(monkeypatch, GCE_METADATA_IP=f"127.0.0.1:{metadata.server_address[1]}/single")
    caplog.set_level("INFO", logger="jax_tinybert")
    assert sharding.maybe_initialize_distributed() is False
    assert calls == [] and not jax.distributed.is_initialized()
    assert ("single", "worker-network-endpoints") in metadata.asked
    assert "Cloud TPU VM (GCE metadata server) with 1 process" in caplog.text


def test_gke_tpu_hosts(metadata, calls, tpu_vm, monkeypatch, caplog):
    # TPU_SKIP_MDS_QUERY, as GKE's TPU pods have it: JAX's GCE class (asked first) then asks
    # nothing (else 6 tries of agent-worker-number, 0.5 s apart); tpu-env is still read.
    _setenv(monkeypatch, TPU_WORKER_HOSTNAMES="localhost,tpu-worker-1", TPU_WORKER_ID=0,
            TPU_SKIP_MDS_QUERY="true",
            GCE_METADATA_IP=f"127.0.0.1:{metadata.server_address[1]}/gke")
    caplog.set_level("INFO", logger="jax_tinybert")
    assert sharding.maybe_initialize_distributed(timeout_s=9) is True
    assert calls == [dict(coordinator_address="localhost:8482", num_processes=2, process_id=0,
                          cluster_detection_method="gketpu", initialization_timeout=9)]
    assert "started from TPU on GKE (TPU_WORKER_HOSTNAMES): process 0 of 2" in caplog.text


@pytest.mark.parametrize("process", [0, 1])
def test_a_slurm_step(calls, monkeypatch, listener, process):
    _setenv(monkeypatch, SLURM_JOB_ID=4242, SLURM_NTASKS=2, SLURM_PROCID=process,
            SLURM_LOCALID=process, JTB_HEARTBEAT_TIMEOUT=7)
    if process == 0:   # the first node of the step, on a port derived from the job id
        _setenv(monkeypatch, SLURM_STEP_NODELIST="gpu[003-004]")
        address = f"gpu003:{4242 % 4096 + 61440}"
    else:              # process 1 waits for process 0 first: a listening port stands in
        _setenv(monkeypatch, SLURM_STEP_NODELIST="127.0.0.1,127.0.0.2",
                JAX_COORDINATOR_PORT=listener)
        address = f"127.0.0.1:{listener}"
    assert sharding.maybe_initialize_distributed(timeout_s=10) is True
    assert calls == [dict(coordinator_address=address, num_processes=2, process_id=process,
                          cluster_detection_method="slurm", initialization_timeout=10,
                          heartbeat_timeout_seconds=7)]


def test_a_one_task_slurm_job_is_left_alone(calls, monkeypatch):
    _setenv(monkeypatch, SLURM_JOB_ID=4242, SLURM_NTASKS=1, SLURM_PROCID=0, SLURM_LOCALID=0,
            SLURM_STEP_NODELIST="gpu003")
    assert sharding.maybe_initialize_distributed() is False and calls == []


def test_an_open_mpi_job(calls, monkeypatch, listener):
    uri = "1531576320.0;tcp://127.0.0.1,10.148.0.1:34911"
    _setenv(monkeypatch, OMPI_MCA_orte_hnp_uri=uri, OMPI_COMM_WORLD_SIZE=4,
            OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_LOCAL_RANK=0)
    assert sharding.maybe_initialize_distributed(timeout_s=10) is True
    # The launcher's address, on a port derived from the job id (1531576320 / 2^12 mod 2^12).
    assert calls.pop() == dict(coordinator_address="127.0.0.1:62624", num_processes=4,
                               process_id=0, cluster_detection_method="ompi",
                               initialization_timeout=10)
    _setenv(monkeypatch, OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_LOCAL_RANK=1,
            JAX_COORDINATOR_PORT=listener)
    assert sharding.maybe_initialize_distributed(timeout_s=10) is True
    assert calls.pop()["coordinator_address"] == f"127.0.0.1:{listener}"


def test_explicit_flags_win_over_a_detected_cluster(calls, monkeypatch):
    _setenv(monkeypatch, SLURM_JOB_ID=4242, SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_LOCALID=1,
            SLURM_STEP_NODELIST="gpu[003-004]", JTB_COORDINATOR="127.0.0.1:1234",
            JTB_NUM_PROCESSES=3, JTB_PROCESS_ID=0)
    assert sharding.maybe_initialize_distributed(timeout_s=10) is True
    assert calls == [dict(coordinator_address="127.0.0.1:1234", num_processes=3, process_id=0,
                          initialization_timeout=10)]


def test_cluster_none_asks_nothing(calls, tpu_vm, monkeypatch):
    # A TPU VM whose metadata server is down, inside a 2-task SLURM step: none of it is read.
    _setenv(monkeypatch, SLURM_JOB_ID=4242, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0,
            SLURM_STEP_NODELIST="gpu[003-004]", GCE_METADATA_IP=f"127.0.0.1:{_free_port()}")
    assert sharding.maybe_initialize_distributed(cluster="none") is False
    assert sharding.maybe_initialize_distributed(auto=False) is False
    monkeypatch.setenv("JTB_CLUSTER", "none")
    assert sharding.maybe_initialize_distributed() is False
    assert calls == []
    # With explicit flags, JAX is told to detect nothing either.
    _setenv(monkeypatch, JTB_COORDINATOR="127.0.0.1:1234", JTB_NUM_PROCESSES=2, JTB_PROCESS_ID=0)
    assert sharding.maybe_initialize_distributed(timeout_s=10) is True
    assert calls[-1]["cluster_detection_method"] == "deactivate"
    # A named method asks that one only: the metadata server is not read for --cluster=slurm.
    monkeypatch.delenv("JTB_COORDINATOR")
    assert sharding.maybe_initialize_distributed(timeout_s=10, cluster="slurm") is True
    assert calls[-1]["cluster_detection_method"] == "slurm"


def test_a_named_cluster_must_be_there(calls, monkeypatch):
    with pytest.raises(sharding.DistributedInitError, match="--cluster=slurm: this is not a "
                       "SLURM job step: it needs an srun step") as e:
        sharding.maybe_initialize_distributed(cluster="slurm")
    assert "--cluster=none" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="--cluster=lsf is not a cluster this JAX .* detects; "
                       "pick one of auto, none, .*gcetpu"):
        sharding.maybe_initialize_distributed(cluster="lsf")
    names = cluster.cluster_names()
    assert {"gcetpu", "gketpu", "slurm", "ompi", "mpi4py", "k8s"} <= set(names)
    assert "tpu" not in names   # the TPU classes' abstract base


def test_kubernetes_is_asked_only_by_name(calls, monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # JAX's K8s class warns when its package is missing
        assert sharding.maybe_initialize_distributed() is False
    try:
        import kubernetes  # noqa: F401
        pytest.skip("the kubernetes package is installed: --cluster=k8s would ask the API")
    except ImportError:
        pass
    with pytest.warns(UserWarning), pytest.raises(
            sharding.DistributedInitError, match=r"pip install 'jax\[k8s\]'"):
        sharding.maybe_initialize_distributed(cluster="k8s")


def test_a_jax_without_the_cluster_classes_says_so(calls, monkeypatch):
    from jax._src import clusters

    monkeypatch.delattr(clusters.ClusterEnv, "_cluster_types")
    with pytest.raises(sharding.DistributedInitError,
                       match="has no jax._src.clusters.ClusterEnv._cluster_types.*--cluster=none"):
        sharding.maybe_initialize_distributed()
    assert sharding.maybe_initialize_distributed(cluster="none") is False


@pytest.mark.timeout(120)
def test_a_metadata_server_that_does_not_answer_stops_the_cli(calls, tpu_vm, monkeypatch,
                                                              tmp_path):
    down = f"127.0.0.1:{_free_port()}"          # nobody listens there
    monkeypatch.setenv("GCE_METADATA_IP", down)
    with pytest.raises(sharding.DistributedInitError) as e:
        sharding.maybe_initialize_distributed()
    msg = str(e.value)
    assert msg.startswith("Cloud TPU VM (GCE metadata server) detection could not tell whether")
    assert f"http://{down} did not answer" in msg and "--cluster=none" in msg and "\n" not in msg
    # The CLI, on a (faked) TPU VM: a non-zero exit, that one line last, nothing written.
    env = _clean(T.env(PYTHONPATH=f"{REPO}{os.pathsep}{HELPERS}"))
    env.update(JAX_FORCE_TPU_INIT="1", GCE_METADATA_IP=down)
    res = subprocess.run([T.PYTHON, "-m", "tpu_vm_main", "--config=configs/demo.py",
                          f"--workdir={tmp_path / 'wd'}"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("jax_tinybert.parallel.cluster.DistributedInitError: Cloud TPU VM")
    assert f"http://{down}" in last and "--cluster=none" in last
    assert not (tmp_path / "wd").exists()
