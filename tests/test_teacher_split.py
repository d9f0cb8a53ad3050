"""The teacher pass split over processes (jax_tinybert/teacher/split.py): parts joined into one
cache equal the one-process pass row for row; a forward spread over a host's devices equals
the one-device forward. The multi-process run itself: tests/test_pod.py."""
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from jax_tinybert.teacher import cache as tc, split
from jax_tinybert.teacher import training as tt

from helpers import gcs_emulator
from helpers import tiny_run as T
from test_teacher_cache import _intermediate, small  # noqa: F401  (the fixture)


def _build(path, small, forward, batches, fp, **kw):
    return tc.build(str(path), fp, forward, small.params, batches, len(small.ds),
                    token_fields=("teacher_attn", "teacher_hidden"), token_dtype="float16", **kw)


@pytest.mark.parametrize("P", [2, 3, 7])
def test_parts_joined_equal_the_one_process_pass_row_for_row(tmp_path, small, P):
    obj, models, _, _ = _intermediate(small)
    forward = tt._training_forward(models, obj, "float16")
    batches = list(tt._row_batches(small.ds, None, (16, 32, 64), 4))
    assert len(batches) >= P
    whole = _build(tmp_path / "whole", small, forward, iter(batches), small.fp)
    fp = dict(small.fp, num_examples=len(small.ds))
    parts = tmp_path / "cache" / f"teacher.parts-of-{P}"
    for p in range(P):
        _build(parts / f"part-{p}", small, forward, split._share(batches, p, P),
               dict(fp, part=[p, P]), warn_missing=False).close()
    (tmp_path / "cache" / "teacher.parts-of-5").mkdir()   # another process count's, left over
    split.join(str(parts), P, str(tmp_path / "cache" / "teacher"), fp, len(small.ds))
    assert sorted(os.listdir(tmp_path / "cache")) == ["teacher"]
    joined = tc.open_cache(str(tmp_path / "cache" / "teacher"), fp, verify=True)  # its crc32s
    every = np.arange(len(small.ds))
    assert joined.filled.all()
    for T_ in (16, 32, 64):
        rows = every[np.asarray(whole.token_index)[:, 0] == T_]
        if len(rows):
            a, b = joined.lookup(rows, seq_len=T_), whole.lookup(rows, seq_len=T_)
            assert set(a) == set(b) == {"teacher_attn", "teacher_hidden", "teacher_logits"}
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} at T={T_}")


@pytest.mark.skipif(gcs_emulator.available() is not None, reason=str(gcs_emulator.available()))
def test_parts_in_a_bucket_are_joined_there_and_removed(small):
    """A gs:// workdir (GCS emulator): parts uploaded, joined by process 0 from its downloads,
    the cache published to the bucket and the parts deleted there; opened from the bucket it
    equals the one-process pass."""
    obj, models, _, _ = _intermediate(small)
    forward = tt._training_forward(models, obj, "float16")
    batches = list(tt._row_batches(small.ds, None, (16, 32, 64), 4))
    fp = dict(small.fp, num_examples=len(small.ds))
    with gcs_emulator.running() as emu:
        root = f"gs://{emu.bucket}/t-{uuid.uuid4().hex[:8]}/cache"
        whole = _build(f"{root}/whole", small, forward, iter(batches), small.fp)
        for p in range(2):
            _build(f"{root}/teacher.parts-of-2/part-{p}", small, forward,
                   split._share(batches, p, 2), dict(fp, part=[p, 2]), warn_missing=False).close()
        local = split.join(f"{root}/teacher.parts-of-2", 2, f"{root}/teacher", fp, len(small.ds))
        names = {o.split("/")[0] for o in gcs_emulator.objects(root)}
        assert names == {"whole", "teacher"}, names
        assert local and os.path.exists(os.path.join(local, "meta.json"))
        joined = tc.open_cache(f"{root}/teacher", fp, verify=True)   # downloaded anew
        rows = np.flatnonzero(np.asarray(whole.token_index)[:, 0] == 32)
        a, b = joined.lookup(rows, seq_len=32), whole.lookup(rows, seq_len=32)
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_share_is_every_pth_batch_and_none_when_there_is_none():
    assert list(split._share(range(10), 1, 3)) == [1, 4, 7]
    assert list(split._share(range(2), 1, 3)) == [1]
    assert split._share(range(2), 2, 3) is None


def test_a_forward_spread_over_four_devices_equals_the_one_device_forward(tmp_path):
    script = textwrap.dedent("""
        import jax, numpy as np
        from jax_tinybert.teacher import cache as tc, split
        from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification,
                                                 random_params)
        assert jax.local_device_count() == 4
        cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=64, num_labels=3)
        model = BertForSequenceClassification(cfg)
        params = random_params(model, 0)
        forward = jax.jit(tc.make_forward(model, cls_layers=(1, 2)))
        rng = np.random.default_rng(0)
        spread = split.Spread(forward, jax.local_devices())
        for R in (8, 6, 1):   # 6 and 1: filler rows pad the batch to 8 and 4
            ids = rng.integers(1, 100, (R, 16)).astype(np.int32)
            mask = (np.arange(16)[None] < rng.integers(3, 17, (R, 1))).astype(np.int32)
            types = np.zeros_like(ids)
            one = jax.device_get(forward(jax.device_put(params), ids, mask, types))
            out = spread(params, ids, mask, types)
            assert set(out) == set(one)
            for k in one:
                assert out[k].shape == one[k].shape, (k, out[k].shape, one[k].shape)
                np.testing.assert_allclose(out[k], one[k], rtol=1e-5, atol=1e-5)
        print("spread ok")
    """)
    env = T.env(XLA_FLAGS=T.FAST_COMPILE_XLA_FLAGS + " --xla_force_host_platform_device_count=4")
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=T.REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "spread ok" in res.stdout, res.stdout + res.stderr[-3000:]


_PROBE = """
import json, sys, jax
from jax_tinybert.parallel import coordination
from jax_tinybert.teacher import split
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
shared, why = split.shared_workdir(sys.argv[3], coordination.Coordinator("probe"))
print("RESULT " + json.dumps({"shared": shared, "why": why}))
"""


@pytest.mark.parametrize("same", [True, False])
def test_the_workdir_probe_tells_a_shared_folder_from_one_per_host(tmp_path, same):
    """Two processes: one workdir for both is shared; a folder of the same path on each 'host'
    (here: each process its own) is not, and both learn it."""
    wds = [tmp_path / ("wd" if same else f"wd{i}") for i in range(2)]
    for wd in wds:
        (wd / "cache").mkdir(parents=True, exist_ok=True)
    addr = f"127.0.0.1:{T.free_port()}"
    got = T.run_scripts(_PROBE, [(addr, i, wd) for i, wd in enumerate(wds)], T.env(), 120)
    assert [r["shared"] for r in got] == [same, same], got
    if not same:
        assert "is not one folder for all processes" in got[0]["why"]
    assert not any(os.listdir(d / "cache") for d in tmp_path.iterdir()), "a probe file was left"
