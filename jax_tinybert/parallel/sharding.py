"""Devices, meshes and partitioning: one program from 1 CPU to a multi-host pod.

The mesh has three named axes: `data` (pure data parallelism), `fsdp` (data parallel AND params /
optimizer state sharded, ZeRO-3 style) and `model` (tensor parallel for the encoder matmuls).
The batch dimension is split over ("data", "fsdp"). Parameters are placed by regex rules on
their path ("student/bert/encoder/layer/3/attention/self/query/kernel").
"""
from __future__ import annotations

import logging
import math
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


class MeshError(ValueError):
    """The mesh asked for cannot be laid out on these devices (one line: what and the fix)."""


# Test-only: "interleaved" orders the devices host by host in turn (process 0's first device,
# process 1's first, ...), as a TPU torus may, so CPU tests meet a mesh where a host's devices
# are not one block of the batch axis.
DEVICE_ORDER_ENV = "JTB_TEST_DEVICE_ORDER"


def _ordered(devices: list) -> list:
    order = os.environ.get(DEVICE_ORDER_ENV, "")
    if order in ("", "plain"):
        return devices
    if order != "interleaved":
        raise MeshError(f"{DEVICE_ORDER_ENV}={order!r}: expected plain or interleaved")
    seen: dict = {}
    rank = []           # each device's index among its own process's devices
    for d in devices:
        rank.append(seen.get(d.process_index, 0))
        seen[d.process_index] = rank[-1] + 1
    order_ = sorted(range(len(devices)), key=lambda i: (rank[i], devices[i].process_index))
    return [devices[i] for i in order_]


def make_mesh(spec: Optional[dict] = None, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A Mesh over all (global) devices with axes ('data', 'fsdp', 'model').

    One slice: `jax.make_mesh`, which orders TPU chips by their torus coordinates (so a host's
    chips need not be one block of the mesh; nothing here assumes they are). Several slices
    (devices with distinct `slice_index`): `mesh_utils.create_hybrid_device_mesh` with the data
    axis across the slices, over DCN. A shape the topology cannot take raises MeshError; the
    mesh is never guessed.
    """
    devices = _ordered(list(devices if devices is not None else jax.devices()))
    sizes = mesh_shape(dict(spec or {"data": -1}), len(devices))
    named = dict(zip(AXES, sizes))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    slices = sorted({getattr(d, "slice_index", 0) or 0 for d in devices})
    try:
        if len(slices) > 1:
            n = len(slices)
            if sizes[0] % n:
                raise MeshError(
                    f"config.mesh {named}: the {n} slices need mesh.data to be a multiple of {n} "
                    "(the data axis spans the slices over DCN); set mesh.data=-1 or a multiple")
            from jax.experimental import mesh_utils

            arr = mesh_utils.create_hybrid_device_mesh((sizes[0] // n,) + tuple(sizes[1:]),
                                                       (n, 1, 1), devices=devices)
            return Mesh(arr, AXES, axis_types=auto)
        return jax.make_mesh(sizes, AXES, axis_types=auto, devices=devices)
    except MeshError:
        raise
    except (ValueError, NotImplementedError, AssertionError) as e:
        kind = getattr(devices[0], "device_kind", devices[0].platform)
        raise MeshError(
            f"config.mesh {named} cannot be laid out on {len(devices)} {kind} device(s) in "
            f"{len(slices)} slice(s): {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
            "choose axis sizes that follow the topology (e.g. mesh.model within a host)") from e


def check_model_axis(mesh: Mesh, num_heads: int, ffn: int, who: str = "student") -> None:
    """Raises MeshError unless mesh.model divides the attention heads and the FFN width."""
    m = mesh.shape["model"]
    if m > 1 and (num_heads % m or ffn % m):
        raise MeshError(f"config.mesh.model={m} must divide the {who}'s {num_heads} attention "
                        f"heads and its FFN width {ffn}; choose a common divisor")


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


def smallest_global_batch(mesh: Mesh, grad_accum: int = 1) -> int:
    """The least global batch the mesh can split: each of grad_accum micro-batches over the
    data-parallel devices, and whole rows for every process."""
    return math.lcm(data_parallel_size(mesh) * grad_accum, jax.process_count())


def check_batch_size(global_batch: int, mesh: Mesh, grad_accum: int = 1) -> None:
    """Raises a clear error when the batch cannot be split over the mesh / accumulation steps."""
    least = smallest_global_batch(mesh, grad_accum)
    if global_batch % least:
        dp = data_parallel_size(mesh)
        raise MeshError(
            f"config.train.batch_size={global_batch} cannot be split over the mesh (data "
            f"{mesh.shape['data']} x fsdp {mesh.shape['fsdp']} = {dp} data-parallel devices, "
            f"grad_accum {grad_accum}, {jax.process_count()} process(es)): the smallest valid "
            f"global batch is {least} (any multiple of it), or set config.train.per_device_batch "
            f"to make it per_device_batch x {dp}")


def global_batch(per_device: int, mesh_spec: dict, num_devices: int, grad_accum: int = 1) -> int:
    """config.train.per_device_batch -> the global batch: per_device rows on each of the mesh's
    data-parallel devices, per accumulation micro-batch."""
    data, fsdp, _ = mesh_shape(mesh_spec, num_devices)
    return int(per_device) * data * fsdp * int(grad_accum)


# The frozen teacher stays whole on every device while its params take at most this share of
# one device's memory: then no step all-gathers it (FSDP would, every step).
TEACHER_REPLICATED_SHARE = 0.25


def device_memory() -> Optional[int]:
    """Bytes one local device may hold (its allocator's limit), None where unknown (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    return stats.get("bytes_limit")


def teacher_shardings(tree, mesh: Mesh, fsdp_min_size: int, placement: str = "auto",
                      device_bytes: Optional[int] = None):
    """(NamedShardings for the frozen teacher's params, a line saying which was chosen).

    placement: "replicated" (whole on every device; only the model axis's tensor-parallel
    split, which costs no all-gather), "sharded" (the student's rules, FSDP included), or
    "auto": replicated while it takes <= TEACHER_REPLICATED_SHARE of a device's memory
    (`device_bytes`, default `device_memory()`; unknown = replicated), sharded otherwise.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    limit = device_memory() if device_bytes is None else device_bytes
    why = f"{nbytes / 2**20:,.0f} MiB"
    if placement == "auto":
        fits = limit is None or nbytes <= TEACHER_REPLICATED_SHARE * limit
        placement = "replicated" if fits or mesh.shape["fsdp"] == 1 else "sharded"
        if limit is not None:
            why += f", {nbytes / limit:.0%} of a device's {limit / 2**30:,.1f} GiB"
    if placement not in ("replicated", "sharded"):
        raise MeshError(f"config.mesh.teacher={placement!r}: expected auto, replicated or sharded")
    sh = state_shardings(tree, mesh, fsdp_min_size if placement == "sharded" else 2 ** 62)
    if placement == "sharded" and mesh.shape["fsdp"] > 1:
        note = f"teacher params: sharded over fsdp={mesh.shape['fsdp']} ({why}; all-gathered each step)"
    else:
        note = f"teacher params: whole on every device ({why})"
    return sh, note


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
