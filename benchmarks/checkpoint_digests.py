#!/usr/bin/env python
"""Checkpoint digests on a gs:// workdir: SHA-256 of every object (downloaded) against the
store's own CRC32C (one listing), through the real Checkpointer on the local GCS emulator.

    .venv/bin/python benchmarks/checkpoint_digests.py [--models tinybert4,bert-base]
        [--scale 1.0] [--repeats 3] [--record]

The state is a model's float32 params with their AdamW moments (`mu`, `nu`), values random
(they compress about as little as trained weights do): `tinybert4` (the student: embeddings,
4 layers 312 wide, the 312 -> 768 fit projection; 14.5M params, ~174 MB) and `bert-base` (a
fine-tuned teacher: 12 layers 768 wide; 109M params, ~1.3 GB); `--scale` scales the
vocabulary. Per path and
repeat (the two paths alternate, one fresh workdir each): `save` + `wait` of one step and
`restore_latest` of it by a new Checkpointer. Downloads are counted at gcsfs's HTTP layer
(digests, orbax's metadata); tensorstore's reads of the arrays at restore, the same on both
paths, are not. Reported: medians over the repeats, and the digest part alone (digests.write
at save, digests.verify at restore).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from unittest import mock

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import gcs_emulator  # noqa: E402

PATHS = {"sha256, downloaded (before)": "sha256", "crc32c of the store (now)": None}


# hidden, feed-forward, layers, fit projection to (None: none)
MODELS = {"tinybert4": (312, 1200, 4, 768), "bert-base": (768, 3072, 12, None)}


def _shapes(model: str, scale: float):
    """Leaf shapes of `model`'s params (weights; biases folded into "ln"), the vocabulary
    scaled by `scale`."""
    h, f, layers, fit = MODELS[model]
    vocab = max(1, int(30522 * scale))
    shapes = {"embeddings": {"word": (vocab, h), "position": (512, h), "type": (2, h)}}
    for i in range(layers):
        shapes[f"layer_{i}"] = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h),
                                "ffn_in": (h, f), "ffn_out": (f, h), "ln": (12, h)}
    if fit:
        shapes["fit"] = {"kernel": (h, fit)}
    return shapes


def _state(model: str, scale: float):
    import jax
    import numpy as np
    import optax

    from jax_tinybert.train.state import TrainState

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jax.numpy.asarray(rng.standard_normal(s, np.float32) * 0.02),
                          _shapes(model, scale), is_leaf=lambda x: isinstance(x, tuple))
    tx = optax.adamw(1e-4)
    st = TrainState.create({"student": params, "proj": {}}, tx, jax.random.key(0))
    grads = jax.tree.map(lambda p: jax.numpy.asarray(rng.standard_normal(p.shape, np.float32)),
                         st.params)
    upd, opt = jax.jit(tx.update)(grads, st.opt_state, st.params)   # non-zero moments
    return st.replace(params=optax.apply_updates(st.params, upd), opt_state=opt)


class _Timed:
    """Wraps a digests function, adding up the seconds spent in it."""

    def __init__(self, fn, **kw):
        self.fn, self.kw, self.s = fn, kw, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **dict(self.kw, **kw))
        finally:
            self.s += time.perf_counter() - t0


def _one(wd: str, state, algorithm) -> dict:
    from jax_tinybert.train import digests
    from jax_tinybert.train.checkpoints import Checkpointer, abstract_like

    # The path before: every object hashed with SHA-256 at save (digests.write downloads them),
    # so the restore's digests.verify downloads them again (the version-1 format's check).
    write = _Timed(digests.write, algorithm=algorithm)
    verify = _Timed(digests.verify)
    with mock.patch.object(digests, "write", write), mock.patch.object(digests, "verify", verify):
        c = Checkpointer(wd, save_interval_steps=1, keep_best=False)
        with gcs_emulator.counting() as saving:
            t0 = time.perf_counter()
            c.save(1, state, {"step": 1})
            c.wait()
            save_s = time.perf_counter() - t0
        c.close()
        c = Checkpointer(wd, save_interval_steps=1, keep_best=False)
        with gcs_emulator.counting() as restoring:
            t0 = time.perf_counter()
            step, _, _ = c.restore_latest(abstract_like(state))
            restore_s = time.perf_counter() - t0
        c.close()
    assert step == 1, step
    return {"save_s": save_s, "save_digest_s": write.s, "save_reads": len(saving.reads),
            "save_MB_read": saving.bytes_read / 1e6, "restore_s": restore_s,
            "restore_verify_s": verify.s, "restore_reads": len(restoring.reads),
            "restore_MB_read": restoring.bytes_read / 1e6}


def _rounded(k: str, v: float):
    if k.endswith("_reads"):
        return int(v)
    return round(v, 3 if v < 1 else 2 if v < 10 else 1)


def _model(emu, model: str, scale: float, repeats: int) -> list:
    """The rows of one model: per path, the medians of `repeats` save + restore runs."""
    from jax_tinybert import fs
    from jax_tinybert.train.checkpoints import state_bytes

    state = _state(model, scale)
    mb = state_bytes(state) / 1e6
    got = {name: [] for name in PATHS}
    for i in range(repeats):
        for name in (list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]):
            wd = f"gs://{emu.bucket}/bench/{model}-{PATHS[name] or 'store'}-{i}"
            got[name].append(_one(wd, state, PATHS[name]))
            print(model, name, json.dumps({k: round(v, 3) for k, v in got[name][-1].items()}),
                  flush=True)
            fsys, path = fs.url_fs(wd)
            fsys.rm(path, recursive=True)    # the emulator keeps objects in memory
    rows = []
    for name, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"model": model, "path": name, "state_MB": round(mb),
                     **{k: _rounded(k, v) for k, v in med.items()}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tinybert4,bert-base",
                   help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--scale", type=float, default=1.0,
                   help="the vocabulary's share of the models' 30522 rows")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", action="store_true")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    if a.scale <= 0 or a.repeats < 1 or not models or set(models) - set(MODELS):
        raise SystemExit(f"error: --models takes names of {sorted(MODELS)}, --scale > 0 and "
                         "--repeats >= 1")
    import results

    meta = results.default_meta()
    print(f"# {meta['cpu']}", flush=True)
    with gcs_emulator.running() as emu:
        rows = [r for m in models for r in _model(emu, m, a.scale, a.repeats)]
    if a.record:
        note = (f"one step of params + AdamW moments (random values) saved and restored on "
                f"fake-gcs-server (localhost, in memory), vocabulary x{a.scale:g}; medians of "
                f"{a.repeats}; reads and MB: gcsfs downloads")
        print("recorded", results.record("checkpoint_digests", results.machine_kind(), rows,
                                         ("model", "path"), dict(meta, note=note)))


if __name__ == "__main__":
    main()
