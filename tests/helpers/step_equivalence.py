"""Run with 8 simulated CPU devices: one tinybert_intermediate step on several meshes.

Prints JSON: max abs param difference of each mesh layout vs the single-device step, and of
grad accumulation 4 x 8 vs one batch of 32.

    step_equivalence.py MODE [LAYOUTS]    # comma list of dp8,fsdp,tp,fused_fsdp,accum4x8 (all)

Every step is the split one (gradient + update programs), but fused_fsdp's: the
one-program step (train.split_update='never') on the fsdp layout.
"""
import json
import os
import sys

# Every layout is compared with the single-device step of this same process, so XLA's cheapest
# backend optimisation (as in tests/helpers/tiny_run.py) changes nothing compared and makes
# each step compile ~3x faster (compiling is nearly all of this helper's time).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jax_tinybert.distill import objectives  # noqa: E402
from jax_tinybert.parallel import sharding as shd  # noqa: E402
from jax_tinybert.train import step as step_lib  # noqa: E402
from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, random_params  # noqa: E402
from jax_tinybert.train.state import TrainState  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "masked"
# Each layout is its own compile: a caller asks only for those it checks.
wanted = (sys.argv[2].split(",") if len(sys.argv) > 2
          else ["dp8", "fsdp", "tp", "fused_fsdp", "accum4x8"])
tcfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=128, num_labels=2)
scfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=2)
teacher, student = BertForSequenceClassification(tcfg), BertForSequenceClassification(scfg)
tparams = random_params(teacher, 0)
sparams = random_params(student, 1)
obj = objectives.make_objective("tinybert_intermediate", {"mode": mode}, scfg, tcfg)
params = {"student": sparams, "proj": obj.init_projection(jax.random.PRNGKey(2))}
# Plain SGD: Adam divides by sqrt(v), which turns float-rounding noise on near-zero gradients
# into full-size updates and would hide what we compare (the gradients of each layout).
NUMBERS = {"learning_rate": np.float32(0.5)}   # the update program's schedule arguments


def optimizer(numbers):
    return optax.sgd(numbers["learning_rate"]), (lambda step: numbers["learning_rate"])


tx, _ = optimizer(NUMBERS)

rng = np.random.default_rng(0)
B, T = 32, 16
lengths = rng.integers(4, T + 1, B) if mode == "masked" else np.full(B, T)
mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
batch = {"input_ids": (rng.integers(1, 128, (B, T)) * mask).astype(np.int32),
         "attention_mask": mask, "token_type_ids": np.zeros((B, T), np.int32),
         "labels": rng.integers(0, 2, B).astype(np.int32), "valid": np.ones(B, np.float32)}


def run(mesh_spec, devices, grad_accum=1, split=True):
    mesh = shd.make_mesh(mesh_spec, devices)
    abstract = jax.eval_shape(lambda p: TrainState.create(p, tx, jax.random.PRNGKey(0)), params)
    ssh = shd.state_shardings(abstract, mesh, fsdp_min_size=64)
    state = jax.jit(lambda p: TrainState.create(p, tx, jax.random.PRNGKey(3)), out_shardings=ssh)(
        shd.put_replicated(params, mesh))
    tsh = shd.state_shardings(tparams, mesh, fsdp_min_size=64)
    # Dropout off so every layout computes the same function.
    loss_fn = step_lib.make_loss_fn(student, teacher, obj, student_dropout=False)
    if split:   # as short runs train (train.split_update)
        f = step_lib.jit_split_train_step(
            step_lib.make_grad_step(loss_fn, grad_accum=grad_accum, mesh=mesh),
            step_lib.make_update_step(optimizer), ssh, tsh, mesh, NUMBERS)
    else:
        f = step_lib.jit_train_step(step_lib.make_train_step(
            loss_fn, optimizer, grad_accum=grad_accum, mesh=mesh), ssh, tsh, mesh, NUMBERS)
    tp = shd.put_sharded(tparams, tsh)
    for _ in range(2):
        state, m = f(state, tp, shd.shard_batch(batch, mesh))
    specs = {str(s.spec) for s in jax.tree_util.tree_leaves(ssh)}
    return jax.device_get(state.params), float(m["loss"]), sorted(specs)


def maxdiff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


devs = jax.devices()
ref, ref_loss, _ = run({"data": 1}, devs[:1])
out = {"devices": len(devs), "ref_loss": ref_loss}
for name, spec in {"dp8": {"data": 8}, "fsdp": {"data": 2, "fsdp": 4},
                   "tp": {"data": 4, "model": 2}}.items():
    if name in wanted:
        p, loss, specs = run(spec, devs)
        out[name] = {"maxdiff": maxdiff(ref, p), "loss": loss, "specs": specs}
if "fused_fsdp" in wanted:   # the one-program step (train.split_update='never'), sharded
    p, loss, specs = run({"data": 2, "fsdp": 4}, devs, split=False)
    out["fused_fsdp"] = {"maxdiff": maxdiff(ref, p), "loss": loss, "specs": specs}
if "accum4x8" in wanted:
    p, loss, _ = run({"data": 8}, devs, grad_accum=4)
    out["accum4x8"] = {"maxdiff": maxdiff(ref, p), "loss": loss}
print(json.dumps(out))
