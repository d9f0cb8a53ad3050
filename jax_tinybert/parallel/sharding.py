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
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_tinybert.errors import UserError

# Starting jax.distributed lives in cluster.py; these names stay importable from here.
from jax_tinybert.parallel.cluster import (  # noqa: F401
    DistributedInitError, maybe_initialize_distributed)

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")


class MeshError(UserError, ValueError):
    """The mesh asked for cannot be laid out on these devices (one line: what and the fix)."""


def mesh_shape(spec: dict, num_devices: int) -> Tuple[int, int, int]:
    """{'data': -1, 'fsdp': 1, 'model': 1} -> concrete sizes; one axis may be -1 (fill)."""
    unknown = set(spec) - set(AXES)
    if unknown:
        raise MeshError(f"config.mesh: unknown axes {sorted(unknown)}; valid axes are {AXES}")
    sizes = [int(spec.get(a, 1)) for a in AXES]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    if len(fill) > 1:
        raise MeshError(f"config.mesh: only one axis may be -1 (fill), got {dict(zip(AXES, sizes))}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if any(s == 0 or s < -1 for s in sizes):
        raise MeshError(f"config.mesh: axis sizes must be positive or -1, got {dict(zip(AXES, sizes))}")
    if fill:
        if num_devices % known:
            raise MeshError(f"config.mesh {dict(zip(AXES, sizes))}: {num_devices} devices are "
                             f"not divisible by the fixed axes' product {known}")
        sizes[fill[0]] = num_devices // known
    if int(np.prod(sizes)) != num_devices:
        raise MeshError(f"config.mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} "
                         f"devices but {num_devices} are available; use -1 on one axis to fill")
    return tuple(sizes)


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


def slice_hosts(mesh: Mesh) -> str:
    """The process of each device along the mesh's batch axes, e.g. "0 1 0 1" where a torus
    interleaves two hosts ("0 0 1 1" in plain order)."""
    devs = mesh.devices.reshape(data_parallel_size(mesh), -1)[:, 0]
    return " ".join(str(d.process_index) for d in devs)


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
