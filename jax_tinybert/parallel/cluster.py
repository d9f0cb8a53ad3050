"""Starting jax.distributed: from explicit flags, else from the cluster JAX itself detects.

Explicit `--coordinator/--num_processes/--process_id` (env JTB_COORDINATOR, JTB_NUM_PROCESSES,
JTB_PROCESS_ID) always win. Otherwise `--cluster` (env JTB_CLUSTER, default `auto`) picks how
the job is found: `auto` asks JAX's own cluster classes (jax._src.clusters) in JAX's order and
takes the first one present; a name (`gcetpu`, `gketpu`, `slurm`, `ompi`, ...; JAX's
`cluster_detection_method` names, `k8s` for its Kubernetes class) asks that one only; `none`
asks nothing. A cluster of more than one process starts jax.distributed; one process (a
single-host TPU VM, a 1-task SLURM job) is left alone. All of it happens before JAX's backend
starts: the classes read only the environment and, on a Cloud TPU VM, the GCE metadata server.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import socket
import time
from typing import Optional

import jax

from jax_tinybert.errors import UserError

log = logging.getLogger(__name__)

AUTO, NONE = "auto", "none"
# Left out of `auto`: a pod of any Kubernetes workload (a notebook, a CI runner) looks like one,
# and its detection needs the `kubernetes` package, API rights and an Indexed Job.
OPT_IN = ("k8s",)
LABELS = {
    "gcetpu": "Cloud TPU VM (GCE metadata server)",
    "gketpu": "TPU on GKE (TPU_WORKER_HOSTNAMES)",
    "slurm": "SLURM job step",
    "ompi": "Open MPI job (mpirun)",
    "mpi4py": "MPI job (mpi4py)",
    "k8s": "Kubernetes Job",
    "flags": "--coordinator/JTB_COORDINATOR",
}
# What each class looks for, for the message when a named one is absent.
NEEDS = {
    "gcetpu": "a Cloud TPU VM (TPU chips and libtpu; TPU_SKIP_MDS_QUERY unset) whose metadata "
              "server answers agent-worker-number",
    "gketpu": "a TPU host (TPU chips and libtpu) with TPU_WORKER_HOSTNAMES (or "
              "TPU_PROCESS_ADDRESSES) and TPU_WORKER_ID",
    "slurm": "an srun step (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, "
             "SLURM_LOCALID)",
    "ompi": "a process started by Open MPI's mpirun (OMPI_MCA_orte_hnp_uri)",
    "mpi4py": "the mpi4py package and an MPI launcher",
    "k8s": "a Kubernetes pod (KUBERNETES_SERVICE_HOST) and the kubernetes package "
           "(pip install 'jax[k8s]')",
}
SKIP_HINT = ("pass --cluster=none (JTB_CLUSTER=none) to run as one process, or "
             "--coordinator/--num_processes/--process_id to name the job")


class DistributedInitError(RuntimeError):
    """jax.distributed could not start (coordinator unreachable, bad process id, ...)."""


class UnknownClusterError(UserError, ValueError):
    """--cluster names no cluster this JAX knows."""


@dataclasses.dataclass
class Job:
    """A multi-process job as found: by which method, where process 0 listens, who we are."""
    method: str
    coordinator: str
    num_processes: int
    process_id: int
    jax_name: str = ""   # the class's cluster_detection_method name, if JAX gives it one

    @property
    def label(self) -> str:
        return LABELS.get(self.method, self.method)


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def _one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}"


def _method(env) -> str:
    # JAX names most classes (cluster_detection_method); K8sCluster has no name: "k8s".
    name = getattr(env, "name", "") or ""
    return name or env.__name__.removesuffix("Cluster").lower()


def cluster_types() -> list:
    """JAX's cluster classes, in the order its own auto-detection tries them (abstract bases,
    such as the TPU classes' common one, left out)."""
    try:
        from jax._src import clusters

        types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError) as e:
        raise DistributedInitError(
            f"this JAX ({jax.__version__}) has no jax._src.clusters.ClusterEnv._cluster_types, "
            f"which cluster detection reads ({_one_line(e)}); {SKIP_HINT}") from e
    return [t for t in types if not any(o is not t and issubclass(o, t) for o in types)]


def cluster_names() -> list:
    """The values --cluster accepts with the JAX installed: auto, none and JAX's methods."""
    return [AUTO, NONE] + [_method(t) for t in cluster_types()]


def _ask(env, what: str, fn, *args, **kwargs):
    """fn(...) of a cluster class; any failure becomes one line naming the class and the fix."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the classes raise whatever their source raises (requests, k8s)
        label = LABELS.get(_method(env), _method(env))
        if type(e).__module__.split(".")[0] == "requests":  # JAX reads the metadata with it
            ip = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
            raise DistributedInitError(
                f"{label} detection could not {what}: the GCE metadata server at http://{ip} "
                f"did not answer ({_one_line(e)}); on a TPU VM check that server "
                f"(GCE_METADATA_IP sets its address), elsewhere {SKIP_HINT}") from e
        fix = SKIP_HINT
        if isinstance(e, ImportError) and e.name:
            fix = f"install {e.name} (pip install {e.name}), or {SKIP_HINT}"
        raise DistributedInitError(
            f"{label} detection could not {what}: {_one_line(e)}; {fix}") from e


def _coordinator_address(env, timeout_s: int) -> str:
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # JAX's own override of the detected one
        return os.environ["JAX_COORDINATOR_ADDRESS"]
    fn = env.get_coordinator_address
    params = inspect.signature(fn).parameters  # its arguments changed across JAX versions
    kwargs = {}
    if "timeout_secs" in params:
        kwargs["timeout_secs"] = timeout_s
    if "override_coordinator_port" in params:
        kwargs["override_coordinator_port"] = os.environ.get("JAX_COORDINATOR_PORT")
    return _ask(env, "find the coordinator's address", fn, **kwargs)


def detect(choice: str = AUTO, timeout_s: int = 120) -> Optional[Job]:
    """The multi-process job this process belongs to, by `choice` (auto, none or a method
    name); None when there is none or it has one process. Starts no JAX backend."""
    choice = (choice or AUTO).strip().lower()
    if choice == NONE:
        return None
    types = cluster_types()
    if choice == AUTO:
        candidates = [t for t in types if not getattr(t, "opt_in_only_method", False)
                      and _method(t) not in OPT_IN]
    else:
        candidates = [t for t in types if _method(t) == choice]
        if not candidates:
            raise UnknownClusterError(
                f"--cluster={choice} is not a cluster this JAX ({jax.__version__}) detects; "
                f"pick one of {', '.join(cluster_names())}")
    env = next((t for t in candidates
                if _ask(t, "tell whether this process is part of one", t.is_env_present)), None)
    if env is None:
        if choice != AUTO:
            raise DistributedInitError(
                f"--cluster={choice}: this is not a {LABELS.get(choice, choice)}: it needs "
                f"{NEEDS.get(choice, 'what JAX looks for')}; {SKIP_HINT}")
        log.debug("no multi-process environment detected: one process")
        return None
    method = _method(env)
    count = int(_ask(env, "read the process count", env.get_process_count))
    if count <= 1:
        log.info("%s with 1 process: jax.distributed is not started", LABELS.get(method, method))
        return None
    process_id = int(_ask(env, "read this process's id", env.get_process_id))
    return Job(method, _coordinator_address(env, timeout_s), count, process_id,
               jax_name=getattr(env, "name", "") or "")


def maybe_initialize_distributed(coordinator: Optional[str] = None,
                                 num_processes: Optional[int] = None,
                                 process_id: Optional[int] = None,
                                 timeout_s: int = 120, auto: bool = True,
                                 heartbeat_timeout_s: Optional[int] = None,
                                 cluster: Optional[str] = None) -> bool:
    """Starts `jax.distributed` when a multi-process run is asked for or detected.

    Explicit: arguments, else env JTB_COORDINATOR (host:port), JTB_NUM_PROCESSES,
    JTB_PROCESS_ID; they win over any detected cluster. Detected: `cluster` (else env
    JTB_CLUSTER, else "auto"; auto=False means "none"), see this module's docstring. Must run
    before any other JAX call. Returns True if initialised. A coordinator that cannot be reached
    fails within `timeout_s` seconds with the address it tried. `heartbeat_timeout_s` (default:
    env JTB_HEARTBEAT_TIMEOUT, else JAX's 100 s) bounds how long the survivors of a crashed or
    killed process wait before they abort.
    """
    coordinator = coordinator or os.environ.get("JTB_COORDINATOR") or None
    num_processes = num_processes if num_processes is not None else _env_int("JTB_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JTB_PROCESS_ID")
    choice = (cluster or os.environ.get("JTB_CLUSTER") or AUTO) if auto else NONE
    if os.environ.get("JTB_CPU_DEVICES") or coordinator:
        # CPU collectives across processes need gloo (XLA has no other CPU backend for them).
        # A config flag only (harmless on GPU/TPU): asking JAX for its backend here would
        # start the backend, after which jax.distributed.initialize refuses to run.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator:
        if num_processes is None or process_id is None:
            raise DistributedInitError(
                f"coordinator {coordinator} given but the process count/id is missing: set "
                "JTB_NUM_PROCESSES and JTB_PROCESS_ID (or --num_processes/--process_id)")
        if not 0 <= process_id < num_processes:
            raise DistributedInitError(f"process id {process_id} is outside 0..{num_processes - 1}")
        if num_processes == 1:
            return False
        job = Job("flags", coordinator, num_processes, process_id)
    else:
        job = detect(choice, timeout_s)
        if job is None:
            return False
        # A count or id given without a coordinator still overrides the detected one.
        job.num_processes = num_processes if num_processes is not None else job.num_processes
        job.process_id = process_id if process_id is not None else job.process_id
        if job.num_processes <= 1:
            return False
    _start(job, timeout_s, heartbeat_timeout_s, deactivate=choice == NONE)
    return True


def _start(job: Job, timeout_s: int, heartbeat_timeout_s: Optional[int], deactivate: bool) -> None:
    """jax.distributed.initialize for `job`; failures become a DistributedInitError."""
    kwargs = dict(coordinator_address=job.coordinator, num_processes=job.num_processes,
                  process_id=job.process_id)
    if job.jax_name:
        # JAX's class then also picks the local devices (one GPU a task under SLURM/MPI).
        kwargs["cluster_detection_method"] = job.jax_name
    elif job.method == "flags" and deactivate:
        kwargs["cluster_detection_method"] = "deactivate"  # --cluster=none: JAX asks nothing
    if job.process_id != 0:
        # JAX aborts the whole process (a C++ fatal error, no Python exception) when the
        # coordinator cannot be reached; check first, so the error names the address.
        t0 = time.monotonic()
        _wait_reachable(job.coordinator, timeout_s, job.process_id, job.num_processes)
        timeout_s = max(1, int(round(timeout_s - (time.monotonic() - t0))))
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _env_int("JTB_HEARTBEAT_TIMEOUT")
    if heartbeat_timeout_s is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
    try:
        jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    except Exception as e:  # jax raises several types; all mean "could not join"
        raise DistributedInitError(
            f"jax.distributed.initialize could not join the job at {job.coordinator} within "
            f"{timeout_s}s (process {job.process_id} of {job.num_processes}, {job.label}): "
            f"{_one_line(e)}. Check that process 0 is running and that the address/port is "
            "reachable from this host.") from e
    (log.info if job.process_id == 0 else log.debug)(
        "jax.distributed started from %s: process %d of %d, coordinator %s, %d local / %d "
        "global devices", job.label, job.process_id, job.num_processes, job.coordinator,
        jax.local_device_count(), jax.device_count())


def _wait_reachable(address: str, timeout_s: float, process_id, num_processes) -> None:
    """Retries a TCP connection to host:port until it succeeds or `timeout_s` runs out."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise DistributedInitError(f"coordinator address {address!r} is not HOST:PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            err = e
        if time.monotonic() + 0.25 >= deadline:
            raise DistributedInitError(
                f"cannot reach the coordinator at {address} within {timeout_s}s (process "
                f"{process_id} of {num_processes}): {type(err).__name__}: {err}. Check that "
                "process 0 is running and that the address/port is reachable from this host.")
        time.sleep(0.25)


__all__ = ["DistributedInitError", "UnknownClusterError", "Job", "maybe_initialize_distributed",
           "detect", "cluster_names", "cluster_types"]
