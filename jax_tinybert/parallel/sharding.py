"""Devices, meshes and partitioning: one program from 1 CPU to a multi-host pod.

The mesh has three named axes: `data` (pure data parallelism), `fsdp` (data parallel AND params /
optimizer state sharded, ZeRO-3 style) and `model` (tensor parallel for the encoder matmuls).
The batch dimension is split over ("data", "fsdp"). Parameters are placed by regex rules on
their path ("student/bert/encoder/layer/3/attention/self/query/kernel").
"""
from __future__ import annotations

import logging
import os
import re
import socket
import time
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")


class DistributedInitError(RuntimeError):
    """jax.distributed could not start (coordinator unreachable, bad process id, ...)."""


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def maybe_initialize_distributed(coordinator: Optional[str] = None,
                                 num_processes: Optional[int] = None,
                                 process_id: Optional[int] = None,
                                 timeout_s: int = 120, auto: bool = True,
                                 heartbeat_timeout_s: Optional[int] = None) -> bool:
    """Starts `jax.distributed` when a multi-process run is asked for or detected.

    Explicit: arguments, else env JTB_COORDINATOR (host:port), JTB_NUM_PROCESSES,
    JTB_PROCESS_ID. Detected (auto=True): SLURM with more than one task, or a multi-host TPU VM;
    JAX reads their own variables then. Must run before any other JAX call. Returns True if
    initialised. A coordinator that cannot be reached fails within `timeout_s` seconds with the
    address it tried. `heartbeat_timeout_s` (default: env JTB_HEARTBEAT_TIMEOUT, else JAX's 100 s)
    bounds how long the survivors of a crashed/killed process wait before they abort (JAX's
    coordination service declares the silent process dead and terminates every other one).
    """
    coordinator = coordinator or os.environ.get("JTB_COORDINATOR") or None
    num_processes = num_processes if num_processes is not None else _env_int("JTB_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JTB_PROCESS_ID")
    if os.environ.get("JTB_CPU_DEVICES") or coordinator:
        # CPU collectives across processes need gloo (XLA has no other CPU backend for them). A config flag only
        # (harmless on GPU/TPU): asking JAX for its backend here would start the backend,
        # after which jax.distributed.initialize refuses to run.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if coordinator:
        if num_processes is None or process_id is None:
            raise DistributedInitError(
                f"coordinator {coordinator} given but the process count/id is missing: set "
                "JTB_NUM_PROCESSES and JTB_PROCESS_ID (or --num_processes/--process_id)")
        if not 0 <= process_id < num_processes:
            raise DistributedInitError(f"process id {process_id} is outside 0..{num_processes - 1}")
        if num_processes == 1:
            return False
        kwargs = dict(coordinator_address=coordinator, num_processes=num_processes,
                      process_id=process_id)
    elif not auto:
        return False
    elif _env_int("SLURM_NTASKS") and _env_int("SLURM_NTASKS") > 1:
        log.info("SLURM job with %s tasks: starting jax.distributed from SLURM's variables",
                 os.environ["SLURM_NTASKS"])
    elif os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:
        log.info("multi-host TPU VM detected: starting jax.distributed")
    else:
        return False
    where = coordinator or "auto-detected coordinator"
    if coordinator and process_id != 0:
        # JAX aborts the whole process (a C++ fatal error, no Python exception) when the
        # coordinator cannot be reached; check first, so the error names the address.
        t0 = time.monotonic()
        _wait_reachable(coordinator, timeout_s, process_id, num_processes)
        timeout_s = max(1, int(round(timeout_s - (time.monotonic() - t0))))
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _env_int("JTB_HEARTBEAT_TIMEOUT")
    if heartbeat_timeout_s is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
    try:
        jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    except Exception as e:  # jax raises several types; all mean "could not join"
        raise DistributedInitError(
            f"jax.distributed.initialize could not join the job at {where} within {timeout_s}s "
            f"(process {process_id} of {num_processes}): {e}. Check that process 0 is running "
            "and that the address/port is reachable from this host.") from e
    log.info("jax.distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return True


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


def mesh_shape(spec: dict, num_devices: int) -> Tuple[int, int, int]:
    """{'data': -1, 'fsdp': 1, 'model': 1} -> concrete sizes; one axis may be -1 (fill)."""
    unknown = set(spec) - set(AXES)
    if unknown:
        raise ValueError(f"config.mesh: unknown axes {sorted(unknown)}; valid axes are {AXES}")
    sizes = [int(spec.get(a, 1)) for a in AXES]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    if len(fill) > 1:
        raise ValueError(f"config.mesh: only one axis may be -1 (fill), got {dict(zip(AXES, sizes))}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"config.mesh: axis sizes must be positive or -1, got {dict(zip(AXES, sizes))}")
    if fill:
        if num_devices % known:
            raise ValueError(f"config.mesh {dict(zip(AXES, sizes))}: {num_devices} devices are "
                             f"not divisible by the fixed axes' product {known}")
        sizes[fill[0]] = num_devices // known
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(f"config.mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} "
                         f"devices but {num_devices} are available; use -1 on one axis to fill")
    return tuple(sizes)


def make_mesh(spec: Optional[dict] = None, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A Mesh over all (global) devices with axes ('data', 'fsdp', 'model')."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(dict(spec or {"data": -1}), len(devices))
    try:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # CPU / odd topologies: plain order is fine
        arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, AXES)


# --- partition rules -----------------------------------------------------------------------

# Tensor-parallel (Megatron) layout for BERT: column-parallel Q/K/V and FFN-in, row-parallel
# attention-out and FFN-out, so each layer needs one all-reduce per block.
MODEL_PARALLEL_RULES = (
    (r"attention/self/(query|key|value)/kernel$", P(None, "model")),
    (r"attention/self/(query|key|value)/bias$", P("model")),
    (r"attention/output/dense/kernel$", P("model", None)),
    (r"intermediate/dense/kernel$", P(None, "model")),
    (r"intermediate/dense/bias$", P("model")),
    (r"layer/\d+/output/dense/kernel$", P("model", None)),
)


def _path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _spec_for(path: str, shape: Tuple[int, ...], mesh: Mesh, fsdp_min_size: int) -> P:
    spec = [None] * len(shape)
    if mesh.shape["model"] > 1:
        for rx, rule in MODEL_PARALLEL_RULES:
            if re.search(rx, path):
                spec = list(rule) + [None] * (len(shape) - len(rule))
                break
    n = mesh.shape["fsdp"]
    if n > 1 and int(np.prod(shape or (1,))) >= fsdp_min_size:
        # Shard the largest still-free dimension divisible by the fsdp size.
        dims = sorted(range(len(shape)), key=lambda d: -shape[d])
        for d in dims:
            if spec[d] is None and shape[d] % n == 0:
                spec[d] = "fsdp"
                break
    for d, ax in enumerate(spec):
        if ax is not None and shape[d] % mesh.shape[ax]:
            spec[d] = None  # not divisible: keep that dimension whole
    return P(*spec)


def state_shardings(tree, mesh: Mesh, fsdp_min_size: int = 2 ** 14):
    """NamedShardings for a pytree of arrays / ShapeDtypeStructs (params, opt state, TrainState).

    Replicated by default; tensor-parallel rules on the `model` axis; with `fsdp` > 1 every
    tensor of at least `fsdp_min_size` elements is split along its largest divisible dimension.
    Optimizer moments share their parameter's path suffix, so they shard like the parameter.
    """
    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, _spec_for(_path_str(path), shape, mesh, fsdp_min_size))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp; the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_size(global_batch: int, mesh: Mesh, grad_accum: int = 1) -> None:
    """Raises a clear error when the batch cannot be split over the mesh / accumulation steps."""
    dp = data_parallel_size(mesh)
    if global_batch % grad_accum:
        raise ValueError(f"config.train.batch_size={global_batch} is not divisible by "
                         f"config.train.grad_accum={grad_accum}")
    micro = global_batch // grad_accum
    if micro % dp:
        raise ValueError(
            f"config.train.batch_size={global_batch} (micro-batch {micro} with grad_accum "
            f"{grad_accum}) is not divisible by the data-parallel size {dp} "
            f"(mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}); choose a multiple of {dp}")
    if global_batch % jax.process_count():
        raise ValueError(f"config.train.batch_size={global_batch} is not divisible by the "
                         f"{jax.process_count()} processes")


def shard_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Per-process numpy batch (leading dim = global / process_count) -> global jax arrays."""
    sh = batch_sharding(mesh)
    out = {}
    for k, v in local_batch.items():
        v = np.asarray(v)
        global_shape = (v.shape[0] * jax.process_count(),) + v.shape[1:]
        out[k] = jax.make_array_from_process_local_data(sh, v, global_shape)
    return out


def put_replicated(tree, mesh: Mesh):
    """Host arrays -> arrays replicated on every device of the mesh (works multi-process)."""
    sh = replicated(mesh)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_callback(np.shape(x), sh, lambda idx: np.asarray(x)[idx]),
        tree)


def put_sharded(tree, shardings):
    """Host arrays (the full value on every process) -> arrays with the given shardings."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
        tree, shardings)
