"""Config values out of range are refused before anything is written; the workdir rule
(only a run that saved a checkpoint owns its workdir; fields that do not change the result
may change; num_steps / num_epochs changes name the schedule change)."""
import hashlib
import json
import logging
import os
import pathlib

import pytest

from jax_tinybert.train import build
from jax_tinybert.config import schema as config_base, check as cc
from jax_tinybert.errors import UserError

REPO = pathlib.Path(__file__).resolve().parents[1]


def _set(c, field, value):
    """c with one field set, the objective / optimizer defaults filled in (as a run does)."""
    sec, _, name = field.rpartition(".")
    with c.ignore_type():
        (c[sec] if sec else c)[name] = value
    return build.with_defaults(c)


@pytest.mark.parametrize("field,value,want", [
    ("optim.learning_rate", -3e-5, r"must be > 0 \(a negative rate trains by gradient ascent\)"),
    ("optim.learning_rate", float("nan"), "must be a finite number > 0"),
    ("train.num_steps", -1, r"must be >= 0 \(0 = train for config.train.num_epochs epochs\)"),
    ("train.num_epochs", 0.0, "must be > 0"),
    ("optim.warmup_ratio", 1.0, r"must be in \[0, 1\)"),
    ("optim.warmup_ratio", -0.1, r"must be in \[0, 1\)"),
    ("objective.temperature", 0.0, "must be > 0"),
    ("objective.alpha", 1.5, r"must be in \[0, 1\]"),
    ("objective.beta", -1.0, "must be >= 0"),
    ("objective.w_attn", -1.0, "must be >= 0"),
    ("train.batch_size", 0, "must be >= 1"),
    ("train.batch_size", 2.5, "must be an integer >= 1"),
    ("train.grad_accum", 0, "must be >= 1"),
    ("train.eval_batch_size", -8, "must be >= 1"),
    ("train.log_every", 0, "must be >= 1"),
    ("train.checkpoint_every", 0, "must be >= 1"),
    ("train.eval_every", -1, "must be >= 0"),
    ("train.max_to_keep", 0, "must be >= 1"),
    ("train.compile_workers", -2, r"must be >= 0 \(0 = auto"),
    ("train.chunk_tokens", -2, r"must be -1 \(auto\) or >= 0"),
    ("train.chunk_tokens", 1.5, "must be an integer"),
    ("data.max_len", 2, r"must be in \[4, 8192\]"),
    ("data.buckets", (0, 64), "must be a tuple of positive integers"),
    ("data.max_buckets", 0, "must be >= 1"),
    ("optim.weight_decay", -0.01, "must be >= 0"),
    ("optim.b1", 1.0, r"must be in \[0, 1\)"),
    ("optim.b2", 1.2, r"must be in \[0, 1\)"),
    ("optim.eps", 0.0, "must be > 0"),
    ("optim.clip_norm", -1.0, "must be >= 0"),
    ("student.dropout", "yes", "must be True or False"),
    ("student.num_hidden_layers", 0, "must be >= 1"),
    ("student.hidden_size", 100, "not a multiple of config.student.num_attention_heads=12"),
    ("objective.mode", "strict", "is not valid; expected one of"),
    ("optim.schedule", "cosine", "is not valid; expected one of"),
    ("objective.layer_map", "diagonal", "is not a known map"),
    ("objective.layer_map", "0:0,1", "not a student:teacher pair"),
    ("objective.layer_weights", (1.0, -1.0), "must be numbers >= 0"),
    ("mesh.data", 0, r"must be -1 \(all devices\) or >= 1"),
    ("objective.attn_loss", "ce", r"is not valid; expected one of \('mse', 'kl'\)"),
    ("objective.hidn_loss", "cos", r"is not valid; expected one of \('mse', 'cosine'\)"),
    ("objective.kd_loss", "kl", r"is not valid; expected one of \('ce', 'mse'\)"),
])
def test_bad_values_are_refused_with_field_and_fix(field, value, want):
    c = _set(config_base.base_config(), field, value)
    with pytest.raises(UserError, match=want) as e:
        cc.validate_config(build.with_defaults(c))
    assert f"config.{field}" in str(e.value) or "layer_map" in str(e.value)
    assert "\n" not in str(e.value)


def test_attention_kl_in_parity_mode_is_refused_before_the_run():
    c = _set(config_base.base_config(), "objective.attn_loss", "kl")
    cc.validate_config(c, paths=False)                 # masked, the default mode: runs
    c = _set(c, "objective.mode", "tinybert")
    with pytest.raises(UserError, match="attn_loss='kl' runs in config.objective.mode='masked' "
                                        "only.*--config.objective.mode=masked") as e:
        cc.validate_config(c, paths=False)
    assert "\n" not in str(e.value)
    # Another objective ignores the key, as it ignores every key it does not read.
    cc.validate_config(_set(c, "objective.name", "kd"), paths=False)


def test_every_shipped_config_is_valid():
    import importlib.util

    for name, variant in [("finetune_teacher", "mrpc"), ("task_distill", "sst2_pred"),
                          ("task_distill", "stsb_intermediate"), ("pkd", "sst2_last"),
                          ("general_distill", "tinybert4"), ("demo", "")]:
        spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cc.validate_config(build.with_defaults(mod.get_config(variant)), paths=False)


def test_unknown_fields_name_close_matches():
    base = config_base.base_config()
    assert "did you mean config.train.batch_size" in cc.unknown_field(base, "train.batch_sise")
    assert "did you mean config.optim.learning_rate" in cc.unknown_field(base, "train.learning_rate")
    assert "config.train has: attention, batch_size" in cc.unknown_field(base, "train.foo")
    assert "config.objective has:" in cc.unknown_field(base, "objective.foo")
    assert cc.unknown_field(base, "objective.w_attn") is None


def _cfg(tmp_path):
    c = build.with_defaults(config_base.base_config())   # as a run records it
    c.data.glue_dir = str(tmp_path / "glue")
    return c


def test_a_failed_start_does_not_own_the_workdir(tmp_path):
    w = tmp_path / "w"
    c = _cfg(tmp_path)
    cc.check_workdir(c, str(w))
    assert json.loads((w / "config.json").read_text())["config"]["data.glue_dir"] == c.data.glue_dir
    c.data.glue_dir = str(tmp_path / "other")        # the corrected rerun
    cc.check_workdir(c, str(w))
    assert json.loads((w / "config.json").read_text())["config"]["data.glue_dir"] == c.data.glue_dir


def test_a_run_recorded_before_the_loss_kinds_resumes_and_another_kind_is_named(tmp_path):
    """objective.attn_loss / hidn_loss / kd_loss / probability_shift came after runs were
    recorded: a record without them (as the code before them wrote it) still owns the same
    config, and a changed kind is named."""
    w = tmp_path / "w"
    c = _cfg(tmp_path)
    cc.check_workdir(c, str(w))
    rec = json.loads((w / "config.json").read_text())
    for k in ("objective.attn_loss", "objective.hidn_loss", "objective.kd_loss",
              "objective.probability_shift"):
        rec["config"].pop(k)
        rec["resolved"].pop(k)
    # The fingerprint the code before them wrote: the hash of those resolved fields.
    rec["fingerprint"] = hashlib.sha256(json.dumps(rec["resolved"], sort_keys=True,
                                                   default=str).encode()).hexdigest()[:16]
    assert rec["fingerprint"] != cc.config_fingerprint(c)[0]
    (w / "config.json").write_text(json.dumps(rec))
    (w / "summary.json").write_text("{}")            # a finished run owns the workdir
    cc.check_workdir(c, str(w))                      # the same run, resumed by today's code
    c.objective.hidn_loss = "cosine"
    with pytest.raises(UserError, match=r'objective.hidn_loss: "mse" -> "cosine"'):
        cc.check_workdir(c, str(w))


def test_owned_workdir_accepts_same_data_by_another_path(tmp_path, monkeypatch):
    (tmp_path / "glue").mkdir()
    w = tmp_path / "w"
    c = _cfg(tmp_path)
    cc.check_workdir(c, str(w))
    (w / "summary.json").write_text("{}")            # a finished run owns the workdir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GLUE_DIR", str(tmp_path / "glue"))
    c.data.glue_dir = ""                             # $GLUE_DIR: the same folder
    cc.check_workdir(c, str(w))
    c.data.glue_dir = "glue/../glue"                 # relative: the same folder
    c.train.log_every, c.train.eval_every, c.data.cache_dir = 7, 3, str(tmp_path / "c")
    c.train.checkpoint_every, c.export.enabled = 11, False
    cc.check_workdir(c, str(w))
    c.train.seed = 5
    with pytest.raises(cc.ConfigValueError, match=r"different config \(train.seed: 0 -> 5\); "
                       r"rerun with the run's values"):
        cc.check_workdir(c, str(w))


def test_schedule_change_on_resume_is_named(tmp_path, caplog):
    w = tmp_path / "w"
    c = _cfg(tmp_path)
    c.train.num_steps = 160
    cc.check_workdir(c, str(w))
    (w / "checkpoints" / "120").mkdir(parents=True)
    c.train.num_steps = 200
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.config.check"):
        cc.check_workdir(c, str(w))
    assert "num_steps 160 -> 200 changes the learning-rate schedule (warmup_linear, " \
           "warmup_ratio 0.1) from step 121 on" in caplog.text
    assert "--config.train.num_steps=160" in caplog.text
    caplog.clear()
    c.optim.schedule = "constant"
    c.optim.warmup_ratio = 0.0
    c.train.num_steps = 300
    with pytest.raises(cc.ConfigValueError, match="optim.schedule"):
        cc.check_workdir(c, str(w))                  # the schedule itself is part of the result
    assert os.path.exists(w / "config.json")


def test_paths_are_checked_with_the_field_and_a_fix(tmp_path, monkeypatch):
    from jax_tinybert.errors import PathError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GLUE_DIR", raising=False)
    c = config_base.base_config()
    c.data.kind = "synthetic"
    c.teacher.path = "./my_teacher"
    with pytest.raises(PathError, match=r"config.teacher.path='./my_teacher': no such folder "
                       r"\(relative to .*; pass a model folder holding config.json and "
                       r"model.safetensors, e.g. --config.teacher.path=runs/sst2/teacher/export"):
        cc.validate_config(build.with_defaults(c))
    # A run's export that is not there yet: the recipe run out of order, a stage not finished.
    c.teacher.path = "runs/sst2/teacher/export"
    with pytest.raises(PathError, match=r"config.teacher.path='runs/sst2/teacher/export': no such "
                       r"folder \(relative to .*\): nothing has run in runs/sst2/teacher yet, .*: "
                       r"run jax-tinybert --config=configs/finetune_teacher.py:sst2 "
                       r"--workdir=runs/sst2/teacher first$"):
        cc.validate_config(build.with_defaults(c))
    for step in (100, 208):
        (tmp_path / "runs" / "sst2" / "teacher" / "checkpoints" / str(step)).mkdir(parents=True)
    with pytest.raises(PathError, match=r"the run in runs/sst2/teacher has not finished \(last "
                       r"checkpoint: step 208\), .*: rerun that run's command to resume and "
                       r"finish it$"):
        cc.validate_config(build.with_defaults(c))
    (tmp_path / "runs" / "sst2" / "teacher" / "summary.json").write_text("{}")
    with pytest.raises(PathError, match=r"the run in runs/sst2/teacher finished without an export "
                       r"\(export.enabled=False\): rerun its command with "
                       r"--config.export.enabled=True"):
        cc.validate_config(build.with_defaults(c))
    c.teacher.path = "packaged"
    c.student.init, c.student.path = "pretrained", "runs/general/export"
    with pytest.raises(PathError, match=r"config.student.path='runs/general/export': .*nothing has "
                       r"run in runs/general yet, .*: run the stage that trains the student with "
                       r"--workdir=runs/general \(configs/general_distill.py, or "
                       r"configs/task_distill.py:sst2_intermediate before the prediction stage\) "
                       r"first$"):
        cc.validate_config(build.with_defaults(c))
    c.student.init, c.student.path = "random", ""
    (tmp_path / "t").mkdir()
    c.teacher.path = "t"
    with pytest.raises(PathError, match="config.teacher.path='t': the folder has no config.json "
                       "and no model.safetensors or .* and no tokenizer"):
        cc.validate_config(build.with_defaults(c))
    c.teacher.path = "packaged"
    c.data.kind = "glue"
    with pytest.raises(PathError, match="no GLUE data for SST-2: set GLUE_DIR or "
                       "--config.data.glue_dir"):
        cc.validate_config(build.with_defaults(c))
    c.data.glue_dir = "g"
    with pytest.raises(PathError, match="--config.data.glue_dir=g: no such folder"):
        cc.validate_config(build.with_defaults(c))
    (tmp_path / "g").mkdir()
    with pytest.raises(PathError, match="g/SST-2/train.tsv: no such file"):
        cc.validate_config(build.with_defaults(c))
    c.data.kind, c.data.corpus = "corpus", "texts,more.txt"
    with pytest.raises(PathError, match="config.data.corpus: 'texts': no such file or folder"):
        cc.validate_config(build.with_defaults(c))


def test_a_run_workdir_passed_as_a_model_names_its_export(tmp_path, monkeypatch):
    from jax_tinybert.errors import PathError

    monkeypatch.chdir(tmp_path)
    c = config_base.base_config()
    c.data.kind = "synthetic"
    run = tmp_path / "runs" / "t"
    (run / "checkpoints" / "40").mkdir(parents=True)
    (run / "config.json").write_text("{}")      # a workdir holds the run's config.json
    c.teacher.path = "runs/t"
    with pytest.raises(PathError, match=r"^config.teacher.path='runs/t' is a run's workdir, not a "
                       r"model folder: the run in runs/t has not finished \(last checkpoint: step "
                       r"40\), .*; then pass --config.teacher.path=runs/t/export$"):
        cc.validate_config(build.with_defaults(c))
    (run / "export").mkdir()
    c.teacher.path = "runs/t/"
    with pytest.raises(PathError, match=r"^config.teacher.path='runs/t/' is a run's workdir, not a "
                       r"model folder: its model is in runs/t/export; pass "
                       r"--config.teacher.path=runs/t/export$"):
        cc.validate_config(build.with_defaults(c))


def test_logit_stages_need_a_fine_tuned_teacher():
    c = config_base.base_config()
    c.data.kind = "synthetic"
    # PKD's default beta (None) is computed from the models' shapes, which validate_config does
    # not know: give one, as configs/pkd.py does.
    c.objective.beta = 0.5
    for name in ("tinybert_pred", "kd", "pkd"):
        c.objective.name = name
        with pytest.raises(UserError, match="'packaged' is the pre-trained MiniLM with no "
                           "fine-tuned classifier head.*configs/finetune_teacher.py:sst2"):
            cc.validate_config(build.with_defaults(c))
    c.objective.name = "tinybert_intermediate"
    cc.validate_config(build.with_defaults(c))


def test_auto_dtype_is_the_backends_and_a_resume_where_it_means_another_is_refused(
        tmp_path, monkeypatch):
    """student.dtype / teacher.dtype "auto": bfloat16 on a GPU or TPU, float32 on a CPU; the
    run records the concrete dtype, so a GPU run resumed on a CPU (where auto is float32) is
    another config, named in one line; passing the recorded dtype resumes it."""
    from jax_tinybert.speed import profiles

    assert config_base.base_config().student.dtype == "auto"
    cpu = build.with_defaults(config_base.base_config())
    assert (cpu.student.dtype, cpu.teacher.dtype) == ("float32", "float32")
    monkeypatch.setattr(profiles, "backend", lambda: "gpu")
    c = build.with_defaults(config_base.base_config())
    assert (c.student.dtype, c.teacher.dtype) == ("bfloat16", "bfloat16")
    c.data.glue_dir = str(tmp_path / "glue")
    w = tmp_path / "w"
    cc.check_workdir(c, str(w))                       # the GPU run, recorded
    (w / "summary.json").write_text("{}")
    monkeypatch.setattr(profiles, "backend", lambda: "cpu")
    here = build.with_defaults(config_base.base_config())
    here.data.glue_dir = c.data.glue_dir
    with pytest.raises(UserError) as e:
        cc.check_workdir(here, str(w))
    msg = str(e.value)
    assert 'student.dtype: "bfloat16" -> "float32"' in msg and "\n" not in msg, msg
    assert "rerun with the run's values" in msg
    fixed = config_base.base_config()
    fixed.student.dtype = fixed.teacher.dtype = "bfloat16"
    fixed = build.with_defaults(fixed)
    fixed.data.glue_dir = c.data.glue_dir
    cc.check_workdir(fixed, str(w))
