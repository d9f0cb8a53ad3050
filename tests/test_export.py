"""export_hf: the folder loads in transformers (Flax and PyTorch) with equal logits, round-trips
through load_pretrained, and a crash never leaves a complete-looking or partial folder."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.model import export
from jax_tinybert.cli import export as run_export
from jax_tinybert.model.hf import load_pretrained
from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification, BertModel,
                                   init_params)

SENTENCES = [("the movie was a delight from start to finish", None),
             ("a dull, lifeless script .", "nothing works here"),
             ("He said the bank would open at nine.", "The bank opens at 9 am.")]


def _small_config(num_labels=3, **kw):
    return BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=128, num_labels=num_labels, **kw)


def _random_params(config, seed=0):
    """Random weights, biases and LayerNorm included (so a transposition or naming slip cannot
    hide); numpy instead of model.init, which is slow on CPU for a 30522-row vocabulary."""
    shapes = jax.eval_shape(lambda: init_params(BertForSequenceClassification(config),
                                                jax.random.PRNGKey(0)))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: rng.normal(0, 0.05, s.shape).astype(np.float32), shapes)


def _encode(folder, framework):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    a = [s[0] for s in SENTENCES]
    b = [s[1] or "" for s in SENTENCES]
    return tok(a, b, padding=True, return_tensors=framework)


def _ours(config, params, enc):
    ids, mask, types = (jnp.asarray(np.asarray(enc[k]), jnp.int32)
                        for k in ("input_ids", "attention_mask", "token_type_ids"))
    if "classifier" in params:
        out = BertForSequenceClassification(config).apply({"params": params}, ids, mask, types)
        return np.asarray(out.logits)
    return np.asarray(BertModel(config).apply({"params": params}, ids, mask, types)
                      .last_hidden_state)


def _check_transformers(config, params, out, atol=1e-5):
    import torch
    import transformers as tr

    enc = _encode(out, "np")
    ours = _ours(config, params, enc)
    cls = "classifier" in params
    # _do_init=False: skip a random init of the whole model (slow on CPU), load the file only.
    fx, fparams = (tr.FlaxBertForSequenceClassification if cls else tr.FlaxBertModel
                   ).from_pretrained(out, _do_init=False)
    fo = fx(**{k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")},
            params=fparams)
    flax_out = np.asarray(fo.logits if cls else fo.last_hidden_state)
    pt = (tr.BertForSequenceClassification if cls else tr.BertModel).from_pretrained(out).eval()
    with torch.no_grad():
        po = pt(**{k: torch.as_tensor(np.asarray(enc[k])) for k in
                   ("input_ids", "attention_mask", "token_type_ids")})
    torch_out = (po.logits if cls else po.last_hidden_state).numpy()
    assert ours.shape == flax_out.shape == torch_out.shape
    np.testing.assert_allclose(flax_out, ours, atol=atol, rtol=0)
    np.testing.assert_allclose(torch_out, ours, atol=atol, rtol=0)
    return ours


def test_small_classifier_loads_in_transformers_and_round_trips(tmp_path, teacher_dir):
    config = _small_config(3)
    params = _random_params(config)
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    out = export.export_hf(config, {"student": params, "proj": {"kernel": np.ones((64, 384))}},
                           str(tmp_path / "model"), tokenizer_dir=teacher_dir, id2label=labels)
    files = set(os.listdir(out))
    assert {"config.json", "flax_model.msgpack", "model.safetensors", "vocab.txt",
            "tokenizer.json"} <= files
    with open(os.path.join(out, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["architectures"] == ["BertForSequenceClassification"]
    assert cfg["model_type"] == "bert" and cfg["num_labels"] == 3
    assert cfg["id2label"] == {"0": "neg", "1": "neutral", "2": "pos"}
    assert cfg["label2id"] == {"neg": 0, "neutral": 1, "pos": 2}
    _check_transformers(config, params, out)
    # Projections are never exported.
    from safetensors.numpy import load_file
    assert not any("proj" in k or "fit_dense" in k for k in load_file(f"{out}/model.safetensors"))
    c2, p2 = load_pretrained(out)
    assert c2.num_labels == 3 and c2.id2label == labels and c2.hidden_size == 64
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(p2)


def test_regression_head(tmp_path, teacher_dir):
    config = _small_config(1)
    params = _random_params(config, seed=3)
    out = export.export_hf(config, params, str(tmp_path / "reg"), tokenizer_dir=teacher_dir)
    with open(os.path.join(out, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["num_labels"] == 1 and cfg["problem_type"] == "regression"
    logits = _check_transformers(config, params, out)
    assert logits.shape == (len(SENTENCES), 1)
    c2, _ = load_pretrained(out)
    assert c2.is_regression


def test_teacher_sized_classifier(tmp_path, teacher_dir):
    config, bert = load_pretrained(teacher_dir)
    rng = np.random.default_rng(1)
    params = {"bert": bert, "classifier": {
        "kernel": rng.normal(0, 0.1, (config.hidden_size, 2)).astype(np.float32),
        "bias": np.array([0.1, -0.2], np.float32)}}
    out = export.export_hf(config, params, str(tmp_path / "teacher"), tokenizer_dir=teacher_dir)
    _check_transformers(config, params, out)


def test_encoder_only_export(tmp_path, teacher_dir):
    config = _small_config(2)
    params = _random_params(config, seed=5)["bert"]
    out = export.export_hf(config, params, str(tmp_path / "enc"), tokenizer_dir=teacher_dir)
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["architectures"] == ["BertModel"]
    _check_transformers(config, params, out)
    _, p2 = load_pretrained(out)
    assert set(p2) == {"embeddings", "encoder", "pooler"}


def test_shape_mismatch_is_rejected(tmp_path):
    config = _small_config(2)
    params = _random_params(config)
    with pytest.raises(Exception, match="hidden|shape|fit"):
        export.export_hf(config.replace(intermediate_size=96), params, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("existing", [False, True])
def test_crash_mid_export_leaves_nothing_half_written(tmp_path, monkeypatch, existing):
    config = _small_config(2)
    params = _random_params(config)
    out = tmp_path / "model"
    if existing:
        export.export_hf(config, params, str(out))
        before = {n: (out / n).read_bytes() for n in os.listdir(out)}

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(export, "_write_torch", boom)
    with pytest.raises(OSError, match="simulated"):
        export.export_hf(config, _random_params(config, seed=9), str(out))
    assert os.listdir(tmp_path) == (["model"] if existing else [])  # no temp folders left
    if existing:  # the previous export is intact, byte for byte
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    monkeypatch.undo()
    export.export_hf(config, params, str(out))  # a later export succeeds and replaces it
    assert sorted(os.listdir(tmp_path)) == ["model"]
    assert {"config.json", "flax_model.msgpack", "model.safetensors"} <= set(os.listdir(out))


def _fake_run(workdir, student_params, steps=(5, 10), best=5):
    """A workdir as the trainer leaves it: config.json + checkpoints/ and best/ (Checkpointer)."""
    from jax_tinybert.config import schema as config_base
    from jax_tinybert import optim
    from jax_tinybert.train import loop as train
    from jax_tinybert.train.checkpoints import Checkpointer
    from jax_tinybert.train.state import TrainState

    config = config_base.base_config()
    config.student.update(dict(init="random", num_hidden_layers=2, hidden_size=64,
                               num_attention_heads=4, intermediate_size=128))
    config.data.task = "sst2"
    train.check_workdir(config, str(workdir))
    tx, _ = optim.make_optimizer({"name": "adamw"}, 100)
    ckpt = Checkpointer(str(workdir), async_save=False, save_interval_steps=1,
                        best_metric="main")
    states = {}
    for s in steps:
        p = {"student": jax.tree_util.tree_map(lambda x: jnp.asarray(x) + s, student_params),
             "proj": {"kernel": jnp.ones((64, 384))}}
        states[s] = TrainState.create(p, tx, jax.random.PRNGKey(0))
        ckpt.save(s, states[s], {"data": {}}, force=True)
        if s == best:
            ckpt.save_best(s, states[s], {"data": {}}, 0.9)
    ckpt.close()
    return {s: jax.tree_util.tree_map(np.asarray, st.params["student"]) for s, st in states.items()}


@pytest.mark.parametrize("which", ["best", "latest"])
def test_export_from_workdir(tmp_path, which):
    config = _small_config(2)
    saved = _fake_run(tmp_path / "run", _random_params(config))
    out = tmp_path / "out"
    run_export.main([f"--workdir={tmp_path / 'run'}", f"--out={out}", f"--which={which}"])
    c2, p2 = load_pretrained(str(out))
    want = saved[5 if which == "best" else 10]
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_array_equal(a, b)
    assert c2.hidden_size == 64 and c2.num_hidden_layers == 2 and c2.num_attention_heads == 4
    assert "vocab.txt" in os.listdir(out)


def test_export_of_a_damaged_best_checkpoint_is_refused(tmp_path):
    """A best checkpoint whose data no longer matches its digests is moved aside and the
    export names it and the way out, instead of exporting wrong weights."""
    config = _small_config(2)
    _fake_run(tmp_path / "run", _random_params(config))
    data = max((p for p in (tmp_path / "run" / "best" / "5" / "state").rglob("*")
                if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(FileNotFoundError, match=r"best checkpoint \(step 5\) is damaged.*"
                                                r"--which=latest"):
        run_export.export_from_workdir(str(tmp_path / "run"), str(tmp_path / "out"), "best")
    assert (tmp_path / "run" / "best" / "corrupt_5").is_dir()
    assert not (tmp_path / "out").exists()


def test_run_export_of_a_workdir_without_checkpoints_is_one_line(tmp_path, capsys):
    """`python -m jax_tinybert.cli.export` on a wrong --workdir: one line, status 2 (it was a
    FileNotFoundError traceback, status 1)."""
    from jax_tinybert.errors import tool_exit

    for workdir, what in ((tmp_path / "runs" / "nope", "no such folder (relative to "),
                          (tmp_path, "holds no checkpoint, so there is nothing to export")):
        argv = [f"--workdir={workdir}", f"--out={tmp_path / 'out'}"]
        assert tool_exit(lambda: run_export.main(argv)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: {workdir}: {what}") and err[-1].endswith(
            "; pass the --workdir of a training run"), err
        assert not (tmp_path / "out").exists()
    assert not (tmp_path / "runs").exists()   # a mistyped workdir is not created
