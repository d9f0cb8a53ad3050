"""The sharded jitted step: layouts on 8 simulated devices and gradient accumulation."""
import json
import os
import subprocess
import sys

import pytest

HELPER = os.path.join(os.path.dirname(__file__), "helpers", "step_equivalence.py")


def _run(mode, *layouts):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(HELPER)) + "/..")
    out = subprocess.run([sys.executable, HELPER, mode, *([",".join(layouts)] if layouts else [])],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def masked():
    return _run("masked")


@pytest.fixture(scope="module")
def tinybert():
    return _run("tinybert", "accum4x8")   # its only test reads accum4x8


@pytest.mark.parametrize("layout", ["dp8", "fsdp", "tp", "fused_fsdp"])
def test_sharded_step_equals_single_device(masked, layout):
    r = masked[layout]
    assert masked["devices"] == 8
    # Two steps on 8 devices vs 1: only the order of float reductions differs.
    assert r["maxdiff"] < 1e-5, r
    assert abs(r["loss"] - masked["ref_loss"]) < 1e-5
    if layout in ("fsdp", "fused_fsdp"):
        assert any("fsdp" in s for s in r["specs"]), "params must actually be sharded"
    if layout == "tp":
        assert any("model" in s for s in r["specs"])


def test_grad_accumulation_4x8_equals_batch_32(tinybert):
    # tinybert-mode losses are plain means over equal micro-batches, so the mean of the four
    # micro-batch gradients is exactly the gradient of the batch of 32.
    assert tinybert["accum4x8"]["maxdiff"] < 1e-5, tinybert["accum4x8"]


def test_masked_mode_accumulation_is_per_micro_batch_mean(masked):
    # Documented behaviour: in masked mode each micro-batch is normalised by its own real-token
    # count, so with unequal padding accumulation is close to, not equal to, the big batch.
    r = masked["accum4x8"]
    assert 0 < r["maxdiff"] < 0.05, r


def _built(split: bool, grad_accum: int = 1, objective="tinybert_intermediate"):
    """A tiny teacher -> student step built as training builds it (AdamW with its global-norm
    clipping and warm-up schedule, dropout on), fused or split."""
    from jax_tinybert.train import build
    from jax_tinybert.cli import plan
    from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, random_params

    tcfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      intermediate_size=128, num_labels=2)
    scfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, num_labels=2)
    config = plan.plan_config(objective=objective, grad_accum=grad_accum,
                              split_update="always" if split else "never")
    config.optim.learning_rate = 1e-3
    obj = build.build_objective(config, scfg, tcfg)
    teacher = build.teacher_module(config, tcfg, classifier=True)
    tparams = random_params(teacher, 0)
    sparams = random_params(BertForSequenceClassification(scfg), 1)
    mesh = build.make_mesh(config)
    built = build.build_step(config, student=build.student_module(config, scfg), teacher=teacher,
                             objective=obj, student_params=sparams, teacher_params=tparams,
                             mesh=mesh, total_steps=20)
    return built, sparams, built.put_teacher(tparams)


def _tiny_batch(seed=0, B=8, T=16):
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    return {"input_ids": (rng.integers(1, 128, (B, T)) * mask).astype(np.int32),
            "attention_mask": mask, "token_type_ids": np.zeros((B, T), np.int32),
            "labels": rng.integers(0, 2, B).astype(np.int32), "valid": np.ones(B, np.float32)}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_split_update_is_the_fused_step(grad_accum):
    """Gradient + update programs (what short runs train with) give the one-program step's parameters,
    moments and metrics: same math, the optimizer compiled on its own."""
    import jax
    import numpy as np

    from jax_tinybert.parallel import sharding as shd
    from jax_tinybert.train import step as step_lib

    results = {}
    for split in (False, True):
        built, sparams, tp = _built(split, grad_accum)
        assert isinstance(built.train_step, step_lib.SplitTrainStep) == split
        state = built.init_state(sparams, seed=3)
        for i in range(3):
            state, m = built.train_step(state, tp, shd.shard_batch(_tiny_batch(i), built.mesh))
        results[split] = jax.device_get((state, m))
    (s0, m0), (s1, m1) = results[False], results[True]
    assert int(s1.step) == 3 and sorted(m0) == sorted(m1)
    assert {"loss", "grad_norm", "lr"} <= set(m1)
    for a, b in zip(jax.tree_util.tree_leaves((s0.params, s0.opt_state, m0)),
                    jax.tree_util.tree_leaves((s1.params, s1.opt_state, m1))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def _adamw_numpy(params, grads_seq, *, lr, total, warmup, b1, b2, eps, wd, clip):
    """AdamW as the paper and PyTorch write it, in float64 NumPy, over a sequence of gradient
    dicts {path: array}: the [PAD] (row 0) word-embedding gradient zeroed (PyTorch's
    padding_idx), global-norm clipping, bias-corrected moments, decoupled weight decay off for
    biases and LayerNorm, lr warm-up then linear decay (BertAdam's warmup_linear) indexed by
    the number of updates already applied. -> params after the last update."""
    import numpy as np

    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, grads in enumerate(grads_seq, start=1):
        g = {k: np.array(x, np.float64) for k, x in grads.items()}
        for k in g:
            if k.endswith("word_embeddings/embedding"):
                g[k][0] = 0.0
        norm = np.sqrt(sum(float((x ** 2).sum()) for x in g.values()))
        if norm > clip:
            g = {k: x * clip / norm for k, x in g.items()}
        progress = (t - 1) / total
        rate = lr * (progress / warmup if progress < warmup
                     else max((progress - 1) / (warmup - 1), 0.0))
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            step = (m[k] / (1 - b1 ** t)) / (np.sqrt(v2[k] / (1 - b2 ** t)) + eps)
            leaf = k.split("/")[-1]
            if not (leaf in ("bias", "scale") or "LayerNorm" in k):
                step = step + wd * p[k]
            p[k] = p[k] - rate * step
    return p


def test_update_program_is_adamw_written_in_numpy():
    """The update program that split runs train with, against AdamW written from its formula in
    NumPy (float64): warm-up and decay, global-norm clipping (active on some steps, not others),
    weight decay where the official code applies it, the [PAD] row's gradient dropped."""
    import jax
    import numpy as np

    from jax_tinybert.train import build
    from jax_tinybert import optim
    from jax_tinybert.cli import plan

    built, sparams, _ = _built(True)
    state = built.init_state(sparams, seed=3)
    flat = lambda tree: {jax.tree_util.keystr(kp, simple=True, separator="/"): np.asarray(x)
                         for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    params0 = flat(jax.device_get(state.params))
    rng = np.random.default_rng(0)
    total, scales = 20, (0.5, 3.0, 0.01, 0.2)   # global norms above and below clip_norm 1.0
    grads_seq, norms = [], []
    treedef = jax.tree_util.tree_structure(state.params)
    for sc in scales:
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params0.items()}
        n = np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
        g = {k: x * np.float32(sc / n) for k, x in g.items()}
        grads_seq.append(g)
        norms.append(sc)
    for i, g in enumerate(grads_seq):
        tree = jax.tree_util.tree_unflatten(treedef, [g[k] for k in params0])
        state, m = built.train_step.update(state, tree)
        np.testing.assert_allclose(float(m["grad_norm"]), norms[i], rtol=1e-5)
    opt = dict(build.optimizer_config(plan.plan_config(objective="tinybert_intermediate")))
    opt = {**optim.defaults("adamw"), **opt, "learning_rate": 1e-3}   # _built's lr
    assert opt["clip_norm"] == 1.0 and opt["schedule"] == "warmup_linear"
    want = _adamw_numpy(params0, grads_seq, lr=opt["learning_rate"], total=total,
                        warmup=opt["warmup_ratio"], b1=opt["b1"], b2=opt["b2"], eps=opt["eps"],
                        wd=opt["weight_decay"], clip=opt["clip_norm"])
    got = flat(jax.device_get(state.params))
    assert int(jax.device_get(state.step)) == len(scales)
    moved = 0
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=2e-5, atol=2e-8, err_msg=k)
        moved += not np.allclose(w, params0[k])
    assert moved == len(want)   # every tensor was updated (the first step's lr is 0: warm-up)


def test_split_step_lowers_and_compiles_as_one_step():
    """plan.py and the benchmarks read a step's `.lower(...).compile()`: the split pair runs as
    the step, with both programs' FLOPs and a peak comparable to the fused program's."""
    import jax

    from jax_tinybert.parallel import sharding as shd

    analyses = {}
    for split in (False, True):
        built, sparams, tp = _built(split, objective="tinybert_pred")
        state = built.init_state(sparams, seed=3)
        batch = shd.shard_batch(_tiny_batch(), built.mesh)
        compiled = built.train_step.lower(built.abstract_state, built.abstract_teacher,
                                          batch).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        mem = compiled.memory_analysis()
        state, m = compiled(state, tp, batch)
        assert int(jax.device_get(state.step)) == 1 and float(m["grad_norm"]) > 0
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
        analyses[split] = (float(cost["flops"]), peak, mem.argument_size_in_bytes)
    (f0, p0, a0), (f1, p1, a1) = analyses[False], analyses[True]
    assert abs(f1 / f0 - 1) < 0.05, analyses
    # The arguments (state with moments, teacher, batch) are the same bytes, up to a few of the
    # metrics; the peak holds the gradients either way (outputs or temporaries).
    assert abs(a1 / a0 - 1) < 1e-3 and 0.7 < p1 / p0 < 1.5, analyses


def test_auto_splits_the_update_in_runs_short_for_their_buckets():
    from jax_tinybert import speed
    from jax_tinybert.config import schema as config_base
    from jax_tinybert.config.check import ConfigValueError, validate_config
    from jax_tinybert.train import build

    c = config_base.base_config()
    per = speed.CPU.split_steps_per_bucket
    assert c.train.split_update == "auto"

    def splits(objective, total_steps, num_buckets, backend="cpu"):
        facts = speed.RunFacts(total_steps, total_steps, num_buckets, objective=objective)
        return speed.resolve(c, backend, facts)[0].train.split_update == "always"

    # The intermediate stage was measured no slower split: any length.
    assert splits("tinybert_intermediate", total_steps=10 ** 6, num_buckets=1)
    assert splits("tinybert_pred", total_steps=6 * per, num_buckets=6)        # SST-2, 1 epoch
    assert not splits("tinybert_pred", total_steps=6 * per + 1, num_buckets=6)
    assert not splits("tinybert_pred", total_steps=3 * 2101, num_buckets=6)   # 3 epochs
    assert not splits("tinybert_intermediate", total_steps=1, num_buckets=1, backend="gpu")
    c.train.split_update = "always"
    assert splits("tinybert_pred", total_steps=10 ** 6, num_buckets=1)
    c.train.split_update = "never"
    assert not splits("tinybert_pred", total_steps=1, num_buckets=6)
    c.train.split_update = "sometimes"
    with pytest.raises(ConfigValueError, match="split_update"):
        validate_config(build.with_defaults(c), paths=False)
