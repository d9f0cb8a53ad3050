"""Devices, meshes and partitioning: one program from 1 CPU to a multi-host pod.

The mesh has three named axes: `data` (pure data parallelism), `fsdp` (data parallel AND params /
optimizer state sharded, ZeRO-3 style) and `model` (tensor parallel for the encoder matmuls).
The batch dimension is split over ("data", "fsdp"). Parameters are placed by regex rules on
their path ("student/bert/encoder/layer/3/attention/self/query/kernel").
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Starting jax.distributed lives in cluster.py; these names stay importable from here.
from jax_tinybert.parallel.cluster import (  # noqa: F401
    DistributedInitError, maybe_initialize_distributed)

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")


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
