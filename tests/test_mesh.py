"""The mesh never guesses: device order, slices, the model axis, the batch it can split, where
the frozen teacher lives, and the eval program's pairing of logits with example ids under an
interleaved (torus-like) device order."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from helpers import tiny_run as T
from jax_tinybert.parallel import sharding as shd


@dataclasses.dataclass(frozen=True)
class _Dev:
    id: int
    process_index: int
    slice_index: int = 0
    platform: str = "cpu"
    device_kind: str = "cpu"


def test_interleaved_order_alternates_the_hosts(monkeypatch):
    devs = [_Dev(i, i // 4) for i in range(8)]          # 2 hosts x 4, as processes number them
    monkeypatch.setenv(shd.DEVICE_ORDER_ENV, "interleaved")
    got = shd._ordered(devs)
    assert [(d.process_index, d.id) for d in got] == [
        (0, 0), (1, 4), (0, 1), (1, 5), (0, 2), (1, 6), (0, 3), (1, 7)]
    monkeypatch.setenv(shd.DEVICE_ORDER_ENV, "plain")
    assert shd._ordered(devs) == devs
    monkeypatch.setenv(shd.DEVICE_ORDER_ENV, "torus")
    with pytest.raises(shd.MeshError, match="expected plain or interleaved"):
        shd._ordered(devs)


def test_several_slices_put_the_data_axis_across_them(monkeypatch):
    """Two slices of 4: the data axis's outer half is one slice, the other half the other
    (the slow DCN link carries only the data-parallel gradient reduction)."""
    from jax.experimental import mesh_utils

    devs = [_Dev(i, i // 2, slice_index=i // 4) for i in range(8)]
    arr = {}
    calls = []
    real = mesh_utils.create_hybrid_device_mesh

    def spy(*a, **k):
        calls.append((a[0], a[1]))
        return real(*a, **k)

    monkeypatch.setattr(mesh_utils, "create_hybrid_device_mesh", spy)

    def fake_mesh(arr_, names, axis_types=None):
        arr["devices"] = arr_
        return arr_

    monkeypatch.setattr(shd, "Mesh", fake_mesh)
    got = shd.make_mesh({"data": 4, "fsdp": 2, "model": 1}, devices=devs)
    assert got.shape == (4, 2, 1)
    slices = np.vectorize(lambda d: d.slice_index)(got)
    assert (slices[:2] == 0).all() and (slices[2:] == 1).all(), slices
    with pytest.raises(shd.MeshError, match="the 2 slices need mesh.data to be a multiple of 2"):
        shd.make_mesh({"data": 1, "fsdp": 8, "model": 1}, devices=devs)
    # the ecosystem's own call built it: per-slice (ICI) shape, the slices along data (DCN)
    assert calls[0] == ((2, 2, 1), (2, 1, 1)), calls


def test_a_topology_the_layout_cannot_take_is_an_error_not_a_guess(monkeypatch):
    import jax

    def refuses(*a, **k):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 1 of size 3")

    monkeypatch.setattr(jax, "make_mesh", refuses)
    with pytest.raises(shd.MeshError) as e:
        shd.make_mesh({"data": -1}, devices=jax.devices()[:1])
    msg = str(e.value)
    assert "\n" not in msg and "cannot be laid out on 1 cpu device(s)" in msg
    assert "Failed to find assignment" in msg and "choose axis sizes" in msg


class _Mesh:
    def __init__(self, data, fsdp=1, model=1):
        self.shape = {"data": data, "fsdp": fsdp, "model": model}


def test_model_axis_must_divide_heads_and_ffn():
    shd.check_model_axis(_Mesh(1, model=4), 12, 3072)
    shd.check_model_axis(_Mesh(1, model=1), 5, 7)
    with pytest.raises(shd.MeshError, match=r"mesh.model=8 must divide the teacher's 12 attention "
                                            r"heads and its FFN width 3072"):
        shd.check_model_axis(_Mesh(1, model=8), 12, 3072, "teacher")


def test_batch_the_mesh_cannot_split_names_the_smallest_valid_one():
    shd.check_batch_size(64, _Mesh(64))
    with pytest.raises(shd.MeshError) as e:
        shd.check_batch_size(32, _Mesh(16, fsdp=4))
    msg = str(e.value)
    assert "batch_size=32 cannot be split" in msg and "64 data-parallel devices" in msg
    assert "the smallest valid global batch is 64" in msg and "per_device_batch" in msg
    with pytest.raises(shd.MeshError, match="smallest valid global batch is 48"):
        shd.check_batch_size(32, _Mesh(8), grad_accum=6)
    assert shd.smallest_global_batch(_Mesh(8), 6) == 48
    assert shd.global_batch(4, {"data": -1, "fsdp": 2, "model": 2}, 64) == 4 * 32
    assert shd.global_batch(4, {"data": -1}, 64, grad_accum=2) == 512


_TEACHER = r'''
import os, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax_tinybert.parallel import sharding as shd
mesh = shd.make_mesh({"data": 1, "fsdp": 4, "model": 1})
tree = {"big": jax.ShapeDtypeStruct((1024, 1024), np.float32),      # 4 MiB
        "small": jax.ShapeDtypeStruct((8,), np.float32)}
out = {}
for placement, dev in [("auto", 64 * 2**20), ("auto", 8 * 2**20), ("replicated", 1),
                       ("sharded", 2**40), ("auto", None)]:
    sh, note = shd.teacher_shardings(tree, mesh, 16384, placement, dev)
    out[f"{placement}/{dev}"] = [list(sh["big"].spec), note]
print(json.dumps(out))
'''


def test_frozen_teacher_stays_whole_while_it_fits():
    import json

    res = subprocess.run([sys.executable, "-c", _TEACHER], capture_output=True, text=True,
                         env=T.env(), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    whole, split = [None, None], ["fsdp", None]
    assert out["auto/67108864"][0] == whole              # 4 MiB <= 1/4 of 64 MiB
    assert "whole on every device (4 MiB, 6% of a device's 0.1 GiB)" in out["auto/67108864"][1]
    assert out["auto/8388608"][0] == split               # 4 MiB > 1/4 of 8 MiB
    assert "sharded over fsdp=4" in out["auto/8388608"][1]
    assert out["replicated/1"][0] == whole
    assert out["sharded/1099511627776"][0] == split
    assert out["auto/None"][0] in (whole, split)       # this machine's own answer, either way


_EVAL_ORDER = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.train import step as step_lib

class Echo:       # a "model" whose logits are the first token: the row's own label
    def apply(self, variables, ids, mask, types, **kw):
        class Out: pass
        o = Out(); o.logits = ids[:, :1].astype(np.float32); return o

devs = jax.devices()
# the order a torus may give: the 8 devices not in id order
perm = [0, 4, 1, 5, 2, 6, 3, 7]
mesh = shd.make_mesh({"data": -1}, devices=[devs[i] for i in perm])
fn = step_lib.jit_eval_step(step_lib.make_eval_step(Echo()), shd.replicated(mesh), mesh)
ids = np.arange(16, dtype=np.int64)
batch = {"input_ids": (ids[:, None] * np.ones((1, 4), np.int32)).astype(np.int32),
         "attention_mask": np.ones((16, 4), np.int32), "token_type_ids": np.zeros((16, 4), np.int32),
         "example_id": ids}
logits, got = jax.device_get(fn({}, shd.shard_batch(batch, mesh)))
assert (logits[:, 0].astype(np.int64) == got).all(), (logits[:, 0], got)
print("paired", list(got))
'''


def test_eval_program_returns_each_logit_beside_its_example_id():
    res = subprocess.run([sys.executable, "-c", _EVAL_ORDER], capture_output=True, text=True,
                         env=T.env(), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "paired" in res.stdout
