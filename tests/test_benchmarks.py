"""The benchmarks cannot rot: the PyTorch reference computes our losses, and the throughput
script runs end to end in smoke mode. (Benchmarks are never timed here beyond a sanity bound.)"""
import gzip
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import step_throughput as st  # noqa: E402
from helpers import tiny_run  # noqa: E402
from torch_reference import TorchReference  # noqa: E402

REL = 1e-4


def _losses(stage, tcfg, tparams, scfg, batch):
    sparams = st._random_params(scfg, 2)
    case = st.Case(stage, tcfg, tparams, scfg, sparams, student_dropout=False)
    loss_j, terms_j = jax.jit(case.loss_fn)(
        {"student": case.student_params if stage != "finetune" else tparams, "proj": case.proj},
        case.teacher_params, case.shard(batch), jax.random.PRNGKey(0))
    ref = TorchReference.from_objective(case.obj, case.scfg,
                                        case.student_params if stage != "finetune" else tparams,
                                        case.tcfg, case.host_teacher_params,
                                        jax.device_get(case.proj), student_dropout=False)
    loss_t, terms_t = ref.loss(batch)
    return float(loss_j), {k: float(v) for k, v in terms_j.items()}, float(loss_t.detach()), \
        {k: float(v.detach()) for k, v in terms_t.items()}


def _check(loss_j, terms_j, loss_t, terms_t):
    assert np.isfinite(loss_j) and loss_j > 0
    assert abs(loss_j - loss_t) <= REL * abs(loss_j), (loss_j, loss_t)
    # Terms: the same relative bound plus an absolute floor of 1e-5 for terms that are tiny
    # differences of O(1) float32 numbers (e.g. PKD's KL at T = 10, ~3e-3 after the T^2 factor).
    for k, v in terms_t.items():
        if k in terms_j:
            assert abs(terms_j[k] - v) <= REL * abs(terms_j[k]) + 1e-5, (k, terms_j[k], v)


@pytest.fixture(scope="module")
def tiny_teacher():
    return st.load_teacher("minilm", smoke=True)


@pytest.mark.parametrize("stage", st.STAGES)
@pytest.mark.parametrize("student", ["tinybert4", "l3_d384"])
def test_torch_reference_losses_match_tiny(stage, student, tiny_teacher):
    tcfg, tparams = tiny_teacher
    if stage == "finetune" and student != "tinybert4":
        pytest.skip("finetune trains the teacher itself")
    scfg = st.student_config(student, tcfg, smoke=True)
    batch = st.make_batch(tcfg, 4, 16, seed=3)
    _check(*_losses(stage, tcfg, tparams, scfg, batch))


@pytest.fixture(scope="module")
def minilm(teacher_dir):
    from jax_tinybert.model.hf import load_pretrained

    return load_pretrained(teacher_dir, for_classification=True)


@pytest.mark.parametrize("stage,student", [("tinybert_intermediate", "tinybert4"),
                                           ("pkd", "tinybert4"), ("pkd", "l3_d384")])
def test_torch_reference_losses_match_minilm(stage, student, minilm):
    """The real teacher (MiniLM-L6-H384) and the benchmark's student shapes, at a short length:
    explicit 4 -> 6 layer maps, the shared projection, 12 heads."""
    tcfg, tparams = minilm
    scfg = st.student_config(student, tcfg)
    batch = st.make_batch(tcfg, 4, 24, seed=5)
    _check(*_losses(stage, tcfg, tparams, scfg, batch))


def test_step_throughput_smoke(tmp_path, monkeypatch):
    out = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k != "JTB_BENCH_REEXEC"}
    proc = subprocess.run([sys.executable, str(BENCH / "step_throughput.py"), "--smoke",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    # The script re-executed itself with the glibc malloc settings.
    assert res["machine"]["malloc_env"] == st.MALLOC_ENV
    assert [r["stage"] for r in res["results"]] == list(st.STAGES)
    for r in res["results"]:
        for k in ("s_per_step", "examples_per_s", "gflop_per_s", "torch_s_per_step",
                  "jax_over_torch", "compile_s"):
            assert np.isfinite(r[k]) and r[k] > 0, (r["stage"], k, r[k])
        assert np.isfinite(r["loss"])
    assert res["matmul_peak"]["jax_flop_s"] > 0
    # Wiring, not speed (timings belong in benchmarks/): the printed table carries the numbers.
    rows = [x for x in proc.stdout.splitlines() if x.startswith("| tiny |")]
    assert [x.split("|")[3].strip() for x in rows[:len(st.STAGES)]] == \
        [s.replace("tinybert_", "") for s in st.STAGES]
    # --record's rows, from the same output: one per step, under this CPU's kind.
    monkeypatch.setenv("JTB_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("JTB_MACHINE_KIND", "cpu-test")
    kept = json.loads(pathlib.Path(st.record(res)).read_text())
    assert kept["machine"] == "cpu-test" and kept["key"] == list(st.RECORD_KEY)
    assert [r["stage"] for r in kept["rows"]] == [st.STAGE_SHORT[s] for s in st.STAGES]
    assert all(r["ms_per_step"] > 0 and r["speedup_vs_torch"] > 0 for r in kept["rows"])
    assert kept["runs"][0]["command"].startswith("python benchmarks/step_throughput.py --smoke")
    proc = subprocess.run([sys.executable, str(BENCH / "step_throughput.py"), "--smoke",
                           "--record"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--record: a --smoke run times tiny models" in proc.stderr


def test_compile_cost_smoke(tmp_path):
    out = tmp_path / "cc.json"
    # The wiring, not the seconds: XLA's cheap backend passes halve the script's compilations.
    env = dict(os.environ, XLA_FLAGS=tiny_run.FAST_COMPILE_XLA_FLAGS)
    proc = subprocess.run([sys.executable, str(BENCH / "compile_cost.py"), "--smoke",
                           "--lengths", "8,16", "--batch", "4", "--steps", "1",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["stage"] for r in res["stages"]] == ["finetune", "intermediate", "pred"]
    for r in res["stages"]:
        assert [row["T"] for row in r["rows"]] == [8, 16]
        assert all(row["compile_train_s"] > 0 and row["compile_eval_s"] > 0 for row in r["rows"])
        # Only stages whose teacher outputs are cached compile the teacher-cache forward.
        assert (r["rows"][0]["compile_teacher_forward_s"] > 0) == (r["stage"] == "pred")
        assert r["bucket_in_steps"] == pytest.approx(
            r["compile_per_bucket_s"] / r["step_at_max_len_s"])


def test_matmul_dtypes_smoke(tmp_path):
    """The script as a user runs it, on small shapes: one row per shape, both rates measured,
    and the start-up note's rule written beside them, here for a Zen 4's /proc/cpuinfo."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                    "model\t\t: 17\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512f "
                    "avx512_bf16\n\n")
    out = tmp_path / "mm.json"
    proc = subprocess.run([sys.executable, str(BENCH / "matmul_dtypes.py"), "--repeats", "1",
                           "--shapes", "64x32x48,16x8x24", "--json", str(out),
                           "--cpuinfo", str(info)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["m"], r["k"], r["n"]) for r in res["rows"]] == [(64, 32, 48), (16, 8, 24)]
    assert all(r["f32_gflop_s"] > 0 and r["bf16_gflop_s"] > 0 for r in res["rows"])
    assert res["cpu_fast_bf16"] == "AVX512-BF16 on AMD"
    assert res["cpu"].startswith("AMD EPYC 9R14 (family 25 model 17, ")
    assert "cpu.fast_bf16(): AVX512-BF16 on AMD" in proc.stdout
    assert "| 64 x 32 x 48 |" in proc.stdout


def test_compile_cost_dtype_reaches_every_program(monkeypatch):
    """--dtype bfloat16 builds the train step, the eval step and the teacher forward with both
    models' dtype bfloat16 (the programs whose compile time a bf16 bucket costs). Imported,
    the script leaves the environment alone: its cache switch once stayed in the suite's
    environment and turned the compile cache off for every CLI run started after it."""
    # The module's top level run afresh (an `import` finds it in sys.modules after the first
    # test that imports it, and would check nothing), from an environment without the switch.
    monkeypatch.delenv("JAX_ENABLE_COMPILATION_CACHE", raising=False)
    spec = importlib.util.spec_from_file_location("compile_cost_fresh", BENCH / "compile_cost.py")
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    assert "JAX_ENABLE_COMPILATION_CACHE" not in os.environ
    seen = []

    class Stop(Exception):
        pass

    class Obj:
        teacher_features = None

    def build_step(*a, **kw):
        seen.append(("train step", kw["student_dtype"], kw["teacher_dtype"]))
        return object(), None, None, Obj(), {"teacher_logits": (2,)}

    def student_module(config, scfg):
        seen.append(("eval step", config.student.dtype))

    def teacher_module(config, tcfg, classifier):
        seen.append(("teacher forward", config.teacher.dtype))
        raise Stop

    monkeypatch.setattr(cc.plan, "build_step", build_step)
    monkeypatch.setattr(cc.build, "student_module", student_module)
    monkeypatch.setattr(cc.build, "teacher_module", teacher_module)
    monkeypatch.setattr(cc.step_lib, "make_eval_step", lambda model: (lambda *a: None))
    with pytest.raises(Stop):
        cc.measure("pred", None, None, [8], 4, 1, dtype="bfloat16")
    assert seen == [("train step", "bfloat16", "bfloat16"), ("eval step", "bfloat16"),
                    ("teacher forward", "bfloat16")]


def test_xla_cpu_settings_dtype_reaches_the_children(monkeypatch, tmp_path):
    """--dtype is passed to each step_throughput.py child and recorded in the results."""
    import xla_cpu_settings as xs
    cmds = []

    def run(cmd, **kw):
        cmds.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setattr(xs.subprocess, "run", run)
    out = tmp_path / "s.json"
    assert xs.main(["--smoke", "--dtype", "bfloat16", "--settings", "default", "--rounds", "1",
                    "--json", str(out)]) == 0
    assert cmds and all(c[c.index("--dtype") + 1] == "bfloat16" for c in cmds)
    assert json.loads(out.read_text())["dtype"] == "bfloat16"


def test_step_throughput_accelerator_path(monkeypatch, tmp_path, capsys):
    """The GPU code path (three matmul variants with their errors, pipelined timing, MFU,
    bfloat16 compute, the accelerator table) run on the CPU backend. (PyTorch's side of it is
    skipped: bfloat16 autocast on a CPU is slow, and the smoke test covers the torch step.)"""
    monkeypatch.setattr(st, "on_accelerator", lambda: True)
    assert st.parse_args(["--batch-size", "32,256"]).batch_size == [32, 256]
    args = st.parse_args(["--smoke", "--dtype", "bfloat16", "--no-torch"])
    args.stages = ["tinybert_pred"]
    out = st.run(args)
    v = out["matmul_peak"]["variants"]
    # CPU float32 dots are full float32; bfloat16 operands cost ~3 significant digits.
    assert v["float32_default"]["rel_err"] < 2e-5 and v["float32_highest"]["rel_err"] < 2e-5
    assert 1e-4 < v["bfloat16"]["rel_err"] < 2e-2
    assert out["matmul_peak"]["float32_dot_mode"] == "float32"
    assert [r["batch_size"] for r in out["results"]] == [4]
    for r in out["results"]:
        assert r["dtype"] == "bfloat16" and np.isfinite(r["loss"])
        for k in ("pipelined_s_per_step", "pct_peak", "xla_step_bytes"):
            assert r[k] > 0, (k, r[k])
        assert r["mfu_nominal"] is None  # no datasheet peak for a CPU
        # FLOPs from the lowered (unoptimised) HLO on accelerators; same order as the compiled.
        assert 0.5 < r["gflop_per_step"] / r["gflop_per_step_compiled"] < 2
        # ex/s comes from the pipelined time on an accelerator.
        assert r["examples_per_s"] == pytest.approx(r["batch_size"] / r["pipelined_s_per_step"])
    path = tmp_path / "accel.json"
    path.write_text(json.dumps(out))
    table = st.render([str(path)])
    assert "ms/step pipelined" in table and "bfloat16 " in table


def test_nominal_peaks_and_dot_mode():
    assert st.nominal_peaks("NVIDIA H100 80GB HBM3")["bfloat16"] == 989.4e12
    assert st.nominal_peaks("NVIDIA H100 PCIe")["tf32"] == 378.0e12
    assert st.nominal_peaks("cpu") is None
    assert [st.fp32_dot_mode(e) for e in (3e-7, 3e-4, 3e-3)] == ["float32", "tf32", "bfloat16"]
    peak = {"jax_flop_s": 1.0, "float32_dot_mode": "tf32",
            "variants": {"float32_default": {"flop_s": 2.0}, "float32_highest": {"flop_s": 3.0},
                         "bfloat16": {"flop_s": 4.0}}}
    nom = st.nominal_peaks("H100 80GB HBM3")
    assert st._peak_for("float32", peak, nom, None) == (2.0, 494.7e12)
    assert st._peak_for("float32", peak, nom, "highest") == (3.0, 66.9e12)
    assert st._peak_for("bfloat16", peak, nom, None) == (4.0, 989.4e12)
    assert st._peak_for("float32", {"jax_flop_s": 5.0}, None, None) == (5.0, None)


@pytest.mark.parametrize("baseline", ["HEAD", "full-last-layer"])
def test_ab_modeling_smoke(tmp_path, baseline):
    """Both sides build and time the same step (and the teacher's forward alone); baseline =
    HEAD's modeling.py and dropout.py via git show, or the tree's without cls_only."""
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(BENCH / "ab_modeling.py"), "--smoke",
                           "--baseline", baseline, "--stages",
                           "cached_intermediate,cached_pred,teacher_forward",
                           "--lengths", "8", "--rounds", "2", "--batch-size", "4",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["stage"], r["T"]) for r in res["rows"]] == [("cached_intermediate", 8),
                                                            ("cached_pred", 8),
                                                            ("teacher_forward", 8)]
    for r in res["rows"]:
        assert len(r["baseline_times"]) == len(r["tree_times"]) == 2
        assert r["baseline_s"] > 0 and r["tree_s"] > 0
        assert r["baseline_compile_s"] > 0 and r["tree_compile_s"] > 0


def test_ab_modeling_teacher_forward_computes_in_the_dtype_asked_for():
    """--dtype reaches the teacher_forward stage as it reaches the train steps: in bfloat16 on a
    CPU the products take bf16 operands (build.compute_dtypes); float32 has none."""
    import ab_modeling
    import step_throughput as st
    from jax_tinybert.model import modeling

    tcfg, tparams = st.load_teacher("minilm", smoke=True)
    models = (modeling.BertForSequenceClassification, modeling.BertModel)
    texts = {}
    for dtype in ("float32", "bfloat16"):
        compiled = ab_modeling.make_step("teacher_forward", 8, models, tcfg, tparams, None, None,
                                         2, dtype)[0]
        texts[dtype] = compiled.as_text()
    assert "bf16" not in texts["float32"] and "bf16" in texts["bfloat16"]


def test_ab_modeling_full_last_layer_side_restores_the_objectives():
    """The full-last-layer side's objectives read tokens while its step is built, and only then."""
    import ab_modeling
    from jax_tinybert.distill import objectives as O

    before = {n: c.reads_tokens for n, c in O.REGISTRY.items()}
    assert not before["tinybert_pred"] and before["tinybert_intermediate"]
    with ab_modeling.every_objective_reads_tokens():
        assert all(c.reads_tokens for c in O.REGISTRY.values())
    assert {n: c.reads_tokens for n, c in O.REGISTRY.items()} == before
    assert "reads_tokens" not in O.REGISTRY["pkd"].__dict__   # inherited again, not pinned


def test_mkl_attention_probe_names_what_it_needs_and_finds_its_line(tmp_path):
    """Without MKL the probe exits non-zero with the install line; the attention-product line
    it rewrites in modeling.py is there, once (MKL is not installed here: no timing)."""
    import mkl_attention_probe as probe
    from jax_tinybert.model import modeling

    proc = subprocess.run([sys.executable, str(BENCH / "mkl_attention_probe.py"), "--mkl_lib",
                           str(tmp_path / "libmkl_rt.so.2")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "no such file" in proc.stderr and "pip install mkl" in proc.stderr
    assert open(modeling.__file__).read().count(probe.EINSUM_LINE) == 1


def test_xla_cpu_settings_smoke(tmp_path, monkeypatch, capsys):
    """Each setting runs the step in its own child under its XLA_FLAGS; a child that dies is
    reported as failed (here: a flag XLA does not know), never as a time."""
    import xla_cpu_settings as xs

    monkeypatch.setitem(xs.SETTINGS, "bogus", "--xla_cpu_no_such_flag_jtb=true")
    out = tmp_path / "settings.json"
    assert xs.main(["--smoke", "--settings", "bogus", "--rounds", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["settings"] == ["default", "bogus"]  # default always first
    assert set(res["failed"]) == {"bogus"} and res["failed"]["bogus"]
    # step_throughput --smoke times every stage at T=16 (tiny models)
    assert sorted((r["stage"], r["T"]) for r in res["rows"]) == sorted((s, 16) for s in st.STAGES)
    for row in res["rows"]:
        assert set(row["median_s"]) == {"default"} and row["median_s"]["default"] > 0
    assert set(res["matmul"]) == {"default"}
    text = capsys.readouterr().out
    assert "| pred | 16 |" in text and "bogus: " in text


def test_xla_cpu_settings_summary_by_hand():
    """Medians over rounds and speed against `default`, from hand-made child results."""
    import xla_cpu_settings as xs

    def child(times):
        return {"results": [{"stage": "tinybert_pred", "length": 16, "s_per_step": t}
                            for t in times]}
    rows = xs.summarise({"default": [child([0.2]), child([0.6]), child([0.25])],
                         "eigen": [child([0.5]), child([0.7])]})
    [row] = rows
    assert row["median_s"] == {"default": pytest.approx(0.25), "eigen": pytest.approx(0.6)}
    assert row["speed_vs_default"]["eigen"] == pytest.approx(0.25 / 0.6)
    text = xs.render({"cpu": "x", "rounds": 3, "settings": ["default", "eigen", "onednn_dot"],
                      "failed": {"onednn_dot": "killed by SIGILL"}, "matmul": {}, "rows": rows})
    assert "| pred | 16 | 0.250 | 0.600 | killed by SIGILL | 0.42x | - |" in text


def test_xla_cpu_settings_rejects_unknown_setting(capsys):
    import xla_cpu_settings as xs

    with pytest.raises(SystemExit) as e:
        xs.main(["--settings", "default,eigne"])
    assert e.value.code == 2
    assert "unknown eigne" in capsys.readouterr().err


def test_teacher_pass_smoke(tmp_path, glue_dir):
    """benchmarks/teacher_pass.py end to end on 300 SST-2 sentences: the packed pass forwards
    fewer tokens in one shape and gives the bucketed pass's logits."""
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(BENCH / "teacher_pass.py"), "--task", "sst2",
                           "--glue_dir", str(glue_dir), "--train_subset", "300", "--rounds", "1",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["num_examples"] == 300 and res["packed_tokens"] < res["bucketed_tokens"]
    assert res["compiled_shapes"]["packed"] == 1 < res["compiled_shapes"]["bucketed"]
    assert res["max_abs_logit_diff"] < 1e-4
    assert "round 1 packed" in proc.stdout


def test_teacher_pass_times_the_bucketed_pass_where_packing_would_not_pay(tmp_path, glue_dir):
    """At MRPC's fine buckets packing would not pay (the cache build forwards the pairs
    bucketed): the script times that pass alone instead of exiting with nothing measured."""
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(BENCH / "teacher_pass.py"), "--task", "mrpc",
                           "--glue_dir", str(glue_dir), "--train_subset", "48", "--rounds", "1",
                           "--buckets", "40,48,56,64,80,104,128", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "would not pay" in proc.stdout and "round 1 bucketed" in proc.stdout
    res = json.loads(out.read_text())
    assert list(res["seconds"]) == ["bucketed"] and len(res["seconds"]["bucketed"]) == 1
    assert res["packed_rows"] == 0 and res["max_abs_logit_diff"] is None
    assert list(res["compiled_shapes"]) == ["bucketed"] and res["compiled_shapes"]["bucketed"] > 1


def test_step_profile_smoke(tmp_path, glue_dir):
    """benchmarks/step_profile.py end to end on the CLI's intermediate stage (a tiny random
    teacher and student: 9 s instead of 35 s with the packaged MiniLM and TinyBERT4; 200 SST-2
    sentences, one bucket, the update as its own program): per-program times that add up to the
    step, and a profile with dot thunks."""
    out = tmp_path / "prof.json"
    env = dict(os.environ, JTB_TEACHER_STORE="off", JTB_TOKEN_STORE="off",
               JTB_COMPILE_CACHE="off")
    teacher = tiny_run.tiny_teacher(tmp_path / "teacher")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "step_profile.py"), "--config=configs/task_distill.py:sst2_intermediate",
         f"--workdir={tmp_path / 'run'}", f"--config.teacher.path={teacher}",
         "--config.student.num_hidden_layers=1", "--config.student.hidden_size=32",
         "--config.student.intermediate_size=64", "--config.student.num_attention_heads=4",
         f"--config.data.glue_dir={glue_dir}", "--config.student.init=random",
         "--config.data.train_subset=200", "--config.data.eval_subset=32",
         "--config.data.buckets=(32,)", "--config.train.split_update=always", "--steps=4", "--profile_steps=2", f"--json={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["steps_per_bucket"] == {"32": 4}
    ms = res["median_ms"]["32"]
    assert ms["gradient"] > 0 and ms["update"] > 0
    assert abs(ms["gradient"] + ms["update"] - ms["step"]) < 0.2 * ms["step"]
    assert res["kinds"]["dot fusion (YNNPACK/oneDNN)"] > 0 and res["thunk_s"] > 0
    assert "| 32 | 4 |" in proc.stdout


def test_kernel_profile_readings_by_hand(tmp_path):
    """kernel_profile.py's two readings on hand-written inputs: device kernels summed from a
    perfetto trace (host events left out), and the dots of an HLO text that stayed with XLA."""
    sys.path.insert(0, str(REPO))
    from benchmarks import kernel_profile as kp

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0 (pid 7)"}}]
    ev = [{"ph": "X", "pid": 7, "tid": 1, "name": "input_scatter_fusion_1", "dur": 1200.0},
          {"ph": "X", "pid": 7, "tid": 2, "name": "input_scatter_fusion_1", "dur": 800.0},
          {"ph": "X", "pid": 7, "tid": 1, "name": "nvjet_sm90_tst_64x64_NNT", "dur": 50.0},
          {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(step)", "dur": 9000.0}]
    (tmp_path / "p").mkdir()
    with gzip.open(tmp_path / "p" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + ev}, f)
    got = kp.device_kernel_times(str(tmp_path))
    assert got == {"input_scatter_fusion_1": [pytest.approx(2e-3), 2],
                   "nvjet_sm90_tst_64x64_NNT": [pytest.approx(5e-5), 1]}
    assert kp.kernel_kind("nvjet_sm90_tst_64x64_NNT") == "library GEMM (cuBLAS/CUTLASS)"
    assert kp.kernel_kind("input_scatter_fusion_1") == "scatter / gather"
    assert kp.kernel_kind("loop_multiply_fusion_5") == "XLA fusion"

    hlo = """
%fused_dot (param_0.1: bf16[8,26], param_1.2: f32[26,4]) -> f32[8,4] {
  %param_0.1 = bf16[8,26]{1,0} parameter(0)
  %param_1.2 = f32[26,4]{1,0} parameter(1)
  ROOT %dot.3 = f32[8,4]{1,0} dot(%param_0.1, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/attention/dot_general"}
}
ENTRY %main {
  %gemm = (f32[8,4]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %gemm.1 = (f32[8,4]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
}
"""
    dots = kp.hlo_dots(hlo)
    assert dots["library_calls"] == {"__cublas$lt$matmul": 2}
    assert dots["xla_dots"] == ["f32[8,4]{1,0} = dot(bf16[8,26]{1,0}, f32[26,4]{1,0})  "
                                "jit(step)/attention/dot_general"]


def test_gpu_check_script_says_what_is_missing(tmp_path):
    """benchmarks/gpu_check.sh runs where a device tool sends the repo: without its packed
    folder (or a mode) it stops with exit 2 and says which command fills it."""
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "gpu_check.sh"
    script.write_text((BENCH / "gpu_check.sh").read_text())
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr, r.stderr
    r = subprocess.run(["bash", str(script), "run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "prepare' first" in r.stderr, r.stderr
    r = subprocess.run(["bash", str(script), "prepare"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, GLUE_DIR=str(tmp_path / "none")))
    assert r.returncode == 2 and "SST-2/train.tsv; set GLUE_DIR" in r.stderr, r.stderr
    assert not (tmp_path / ".gpu").exists()

