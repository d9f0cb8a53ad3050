"""The command line as a user meets it: run from a fresh directory with a RELATIVE --workdir,
every mistake prints one line `error: <problem>; <fix>` and exits with status 2, nothing it
leaves behind blocks the corrected rerun in the same workdir, and --help says how to use it.

One fixture: a temp directory holding configs/ (a link to the repo's), a tiny random teacher
(2 layers, d 32), a small SST-2-style GLUE folder, a copy with a non-UTF-8 row and a teacher
with a truncated model.safetensors. Two tiny training runs (2 steps) in all.
"""
import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import tiny_run  # noqa: E402

REPO = tiny_run.REPO
TINY = ["--config.train.num_steps=2", "--config.train.batch_size=8",
        "--config.train.eval_batch_size=16", "--config.data.max_len=16",
        "--config.data.buckets=(16,)", "--config.data.train_subset=32",
        "--config.data.eval_subset=16", "--config.train.log_every=1",
        "--config.train.checkpoint_every=2"]
FINETUNE = ["--config=configs/finetune_teacher.py:sst2", "--workdir=runs/t",
            "--config.teacher.path=teacher", "--config.data.glue_dir=glue", *TINY]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    from jax_tinybert.data import synthetic

    d = tmp_path_factory.mktemp("cli")
    teacher, compile_cache = tiny_run.shared_dirs(tmp_path_factory)
    (d / "configs").symlink_to(REPO / "configs")
    shutil.copytree(teacher, d / "teacher")
    shutil.copytree(teacher, d / "teacher_trunc")
    st = d / "teacher_trunc" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 3])
    synthetic.write_sst2_like(str(d / "glue"), 48, 16, seed=0)
    shutil.copytree(d / "glue", d / "glue_bad")
    bad = d / "glue_bad" / "SST-2" / "train.tsv"
    lines = bad.read_bytes().split(b"\n")
    lines[4] = b"a caf\xe9 review that is not utf-8\t1"   # line 5, Latin-1
    bad.write_bytes(b"\n".join(lines))
    env = tiny_run.env(**tiny_run.cache_env(compile_cache))
    env.pop("GLUE_DIR", None)

    def run(args, timeout=600, module="jax_tinybert.main", **extra):
        e = dict(env, **extra)
        return subprocess.run([tiny_run.PYTHON] + (["-m", module] if module else []) + args,
                              cwd=d, env=e, capture_output=True, text=True, timeout=timeout)
    return d, run


def _one_line_error(r, *needles):
    """rc 2, no traceback, the last stderr line is the one `error: ...` line with needles."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


BAD_INPUTS = [  # (extra args, replacing FINETUNE's where the flag is the same; what the line says)
    (["--config.data.glue_dir="], ["no GLUE data for SST-2: set GLUE_DIR or --config.data.glue_dir",
          "--config.data.glue_dir=../shared/data/glue"]),
    (["--workdir=s3://bucket/run"], ["--workdir=s3://bucket/run: only gs:// buckets (and local "
                                     "folders) are supported", "mount it"]),
    (["--workdir=gs:///run"], ["--workdir=gs:///run: name a bucket"]),
    (["--config.data.task=sst3"], ["config.data.task: unknown GLUE task 'sst3'",
                                   "did you mean SST-2?"]),
    (["--config=configs/finetune_teacher.py:sst3"], ["--config=configs/finetune_teacher.py:sst3: "
                                                     "unknown GLUE task 'sst3'"]),
    (["--config=configs/finetune.py"], ["no such config file 'configs/finetune.py'",
                                        "configs/finetune_teacher.py"]),
    (["--config.train.batch_sise=64"], ["unknown field config.train.batch_sise",
                                        "did you mean config.train.batch_size"]),
    (["--config.train.foo=1"], ["unknown field config.train.foo", "config.train has: attention, batch_size"]),
    (["--config.objective.foo=1"], ["unknown field config.objective.foo"]),
    (["--config.train.batch_size=abc"], ["--config.train.batch_size=abc: bad value",
                                         "expects an integer"]),
    # Fields whose default is the objective's own (None in config_base): their type, not None's.
    (["--config.objective.temperature=abc"], ["--config.objective.temperature=abc: bad value",
                                              "expects a number (default None: the named"]),
    (["--config.objective.probability_shift=yes"], ["expects true or false (default None"]),
    (["--config.optim.learning_rate=-3e-5"], ["config.optim.learning_rate=-3e-05 must be > 0",
                                              "--config.optim.learning_rate="]),
    (["--config.train.num_steps=-1"], ["config.train.num_steps=-1 must be >= 0"]),
    (["--config.objective.alpha=1.5"], ["config.objective.alpha=1.5 must be in [0, 1]"]),
    (["--config.objective.layer_map=0:0,1"], ["'1' is not a student:teacher pair"]),
    (["--config.teacher.path=runs/sst2/teacher/export"],
     ["config.teacher.path='runs/sst2/teacher/export': no such folder (relative to"]),
    (["--config.data.glue_dir=glu"], ["--config.data.glue_dir=glu: no such folder"]),
    (["--config.teacher.path=teacher_trunc"],
     ["teacher_trunc/model.safetensors: cannot read the weights", "truncated or damaged"]),
    (["--config.data.glue_dir=glue_bad"],
     ["glue_bad/SST-2/train.tsv:5: not UTF-8 text (byte 0xe9",
      "--config.data.skip_bad_rows=True"]),
    (["--workdir=runs/t", "extra_argument"], ["unexpected argument 'extra_argument'"]),
]


def _with(base, extra):
    keys = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    return [a for a in base if a.split("=", 1)[0] not in keys] + extra


def test_bad_inputs_print_one_line_and_the_corrected_rerun_works(cli):
    d, run = cli
    # Mistakes caught before anything is read run two at a time (they write nothing); the two
    # that get as far as reading the data and the weights run one after the other.
    early, late = BAD_INPUTS[:-3] + BAD_INPUTS[-1:], BAD_INPUTS[-3:-1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run(_with(FINETUNE, case[0])), early))
    for (extra, needles), r in zip(early, results):
        _one_line_error(r, *needles)
    assert not (d / "runs").exists()          # refused before anything was written
    for extra, needles in late:
        _one_line_error(run(_with(FINETUNE, extra)), *needles)
    # Nothing a failed start left behind owns the workdir: no checkpoint was saved.
    assert not (d / "runs" / "t" / "checkpoints").exists()
    # The corrected rerun, in the same workdir; skip_bad_rows gets past the non-UTF-8 row.
    r = run(_with(FINETUNE, ["--config.data.glue_dir=glue_bad", "--config.data.skip_bad_rows=True"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 bad rows" in r.stderr and "train.tsv:5: not UTF-8" in r.stderr
    assert (d / "runs" / "t" / "summary.json").exists()
    assert (d / "runs" / "t" / "export" / "model.safetensors").exists()
    # Now the run owns its workdir: another config is refused (naming the field), a cadence
    # change and the same data through $GLUE_DIR are not another config.
    _one_line_error(run(_with(FINETUNE, ["--config.data.glue_dir=glue_bad",
                                         "--config.data.skip_bad_rows=True",
                                         "--config.optim.learning_rate=1e-3"])),
                    "workdir runs/t holds a run of a different config (optim.learning_rate: "
                    "5e-05 -> 0.001)", "use a new --workdir")
    # Extending the run (num_steps 2 -> 3) resumes, and says what happens to the schedule.
    r = run(_with(FINETUNE, ["--config.data.glue_dir=glue_bad", "--config.data.skip_bad_rows=True",
                             "--config.train.num_steps=3", "--config.train.log_every=5"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "num_steps 2 -> 3 changes the learning-rate schedule (warmup_linear, warmup_ratio " \
           "0.1) from step 3 on" in r.stderr and "--config.train.num_steps=2" in r.stderr
    assert "resumed from step 2" in r.stdout


def test_pred_stage_without_a_fine_tuned_teacher(cli):
    d, run = cli
    if not (d / "runs" / "t" / "export" / "model.safetensors").exists():
        assert run(FINETUNE).returncode == 0
    pred = ["--config=configs/task_distill.py:sst2_pred", "--workdir=runs/p",
            "--config.data.glue_dir=glue", *TINY]
    _one_line_error(run(pred + ["--config.teacher.path=teacher"]),
                    "config.teacher.path='teacher' has no fine-tuned classifier head",
                    "configs/finetune_teacher.py:sst2",
                    "--config.teacher.path=runs/sst2/teacher/export")
    _one_line_error(run(pred), "config.teacher.path='packaged' is the pre-trained MiniLM")
    r = run(pred + ["--config.teacher.path=runs/t/export"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (d / "runs" / "p" / "summary.json").exists()


def test_verbose_keeps_the_traceback(cli):
    d, run = cli
    r = run(_with(FINETUNE, ["--config.optim.learning_rate=-1.0", "--verbose"]))
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: config.optim.learning_rate=-1.0")


@pytest.mark.parametrize("how", ["module", "console_script"])
def test_help_lists_stages_configs_variants_and_fields(cli, how):
    d, _ = cli
    cmd = [tiny_run.PYTHON, "-m", "jax_tinybert.main", "--help"] if how == "module" else \
        [tiny_run.PYTHON, "-c", "import sys; sys.argv = ['jax-tinybert', '--help']; "
         "from jax_tinybert.main import run; run()"]
    r = subprocess.run(cmd, cwd=d, env=tiny_run.env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    prog = "python -m jax_tinybert.main" if how == "module" else "jax-tinybert"
    assert f"usage: {prog} --config=CONFIG.py[:VARIANT] --workdir=DIR" in out
    for stage in ("finetune_teacher", "general_distill", "task_distill", "pkd", "kd", "demo",
                  "mlm_head"):
        assert f"  {stage} " in out
    for cfg in ("configs/demo.py", "configs/finetune_teacher.py", "configs/general_distill.py",
                "configs/pkd.py", "configs/task_distill.py"):
        assert cfg in out
    assert '"<task>_intermediate" / "<task>_pred"' in out      # task_distill's variants
    assert "--config.train.batch_size=64" in out               # how to override
    assert "train: attention='auto' batch_size=32" in out      # every field with its default
    assert "--config.objective.layer_map=0:0,1:2,2:3,3:5,4:6" in out
    assert "jax-tinybert --config=configs/finetune_teacher.py:sst2 --workdir=runs/sst2/teacher" \
        in out                                                 # an example


def _env_without(*names, **extra):
    env = {k: v for k, v in tiny_run.env().items() if k not in names}
    env.update(extra)
    return env


def test_cli_environment_defaults_reach_jax(tmp_path):
    # jax_tinybert/__init__.py imports jax before main.py sets its defaults, and jax reads its
    # JAX_* variables at import: the compile cache was once silently off for every CLI run.
    # JAX's own threshold keeps only programs that compiled for >= 1 s: the update and the
    # evaluation's programs were compiled again by every run. A user's own value wins.
    code = ("import jax_tinybert.main, jax; c = jax.config; "
            "print(c.jax_compilation_cache_dir, c.jax_platforms, jax.device_count(), "
            "c.jax_persistent_cache_min_compile_time_secs)")
    env = _env_without("JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS", "JTB_COMPILE_CACHE",
                       "XLA_FLAGS", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                       XDG_CACHE_HOME=str(tmp_path), JTB_CPU_DEVICES="3")

    def config(**extra):
        r = subprocess.run([tiny_run.PYTHON, "-c", code], cwd=REPO, env=dict(env, **extra),
                           capture_output=True, text=True, timeout=120)
        return r.stdout.split(), r.stderr

    out, err = config()
    assert out == [str(tmp_path / "jax_tinybert" / "xla"), "cpu", "3", "0.0"], err
    out, err = config(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="2.5")
    assert out == [str(tmp_path / "jax_tinybert" / "xla"), "cpu", "3", "2.5"], err
    out, err = config(JTB_COMPILE_CACHE="off")
    assert out[:3] == ["None", "cpu", "3"], err


def test_the_cli_compiles_for_a_gpu_without_autotuning_unless_asked(tmp_path):
    """XLA's GPU defaults took ~2 min a program (an H200, benchmarks/RESULTS.md#on-a-gpu): a CLI process
    that may use a GPU starts with the two fast-compile flags, a user's own value of either wins,
    JTB_GPU_AUTOTUNE=1 keeps XLA's defaults. A CPU-only one keeps XLA_FLAGS as it was (the flags
    are part of JAX's compile-cache key)."""
    from jax_tinybert.speed import xla_flags

    code = "import os, jax_tinybert.main; print(os.environ.get('XLA_FLAGS'))"

    def flags(**extra):
        env = _env_without("XLA_FLAGS", "JTB_GPU_AUTOTUNE", "JAX_PLATFORMS", "JTB_CPU_DEVICES",
                           **extra)
        r = subprocess.run([tiny_run.PYTHON, "-c", code], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    fast = "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
    assert flags(JAX_PLATFORMS="cuda") == fast
    assert flags(JAX_PLATFORMS="cuda,cpu", JTB_GPU_AUTOTUNE="0") == fast
    assert flags(JAX_PLATFORMS="cuda", XLA_FLAGS="--xla_gpu_autotune_level=4") == \
        "--xla_gpu_autotune_level=4 --xla_gpu_enable_triton_gemm=false"
    assert flags(JAX_PLATFORMS="cuda", JTB_GPU_AUTOTUNE="1") == "None"
    assert flags(JAX_PLATFORMS="cpu") == "None"
    assert flags(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_enable_fast_math=false") == \
        "--xla_cpu_enable_fast_math=false"
    # No JAX_PLATFORMS: a GPU plugin installed decides (this machine has none: checked by hand).
    plugins = [p for d in sys.path if os.path.isdir(d) for p in os.listdir(d)
               if p.startswith(("jax_cuda", "jax_rocm"))
               or (p == "jax_plugins" and os.listdir(os.path.join(d, p)))]
    assert flags() == (fast if plugins else "None"), plugins
    # Where the plugins are found: a CUDA PJRT plugin's folder, or the kernels' package.
    for name in ("jax_plugins/xla_cuda12", "jax_cuda13_plugin"):
        d = tmp_path / name.replace("/", "_")
        (d / name).mkdir(parents=True)
        assert xla_flags.gpu_plugin_installed([str(d)])
        assert xla_flags.gpu_possible({}, [str(d)])
        assert not xla_flags.gpu_possible({"JTB_CPU_DEVICES": "4"}, [str(d)])
        assert not xla_flags.gpu_possible({"JAX_PLATFORMS": "cpu"}, [str(d)])
    (tmp_path / "empty" / "jax_plugins").mkdir(parents=True)
    assert not xla_flags.gpu_plugin_installed([str(tmp_path / "empty")])
    # The start line names the mode: fast only when both flags have the fast values.
    assert xla_flags.gpu_note(fast).startswith("XLA GPU: fast compile")
    for own in ("--xla_gpu_autotune_level=4 --xla_gpu_enable_triton_gemm=false", ""):
        assert xla_flags.gpu_note(own).startswith("XLA GPU: autotuned GEMMs"), own


_MALLOC_VARS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                "GLIBC_TUNABLES", "JTB_MALLOC", "JTB_MALLOC_REEXEC", "LD_PRELOAD", "JTB_TCMALLOC",
                "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", "TCMALLOC_RELEASE_RATE")


def test_the_cli_restarts_once_with_the_fast_allocator_unless_the_user_has_own_settings():
    """On glibc the command restarts itself (same PID) with malloc.MALLOC_ENV, and tcmalloc
    preloaded where installed, when started without them; the Makefile's MALLOC_* values alone
    restart it only to add tcmalloc; a user's own MALLOC_*, JTB_MALLOC=off keep the process as
    started; JTB_MALLOC=glibc and a user's LD_PRELOAD get no tcmalloc."""
    from jax_tinybert.speed.malloc import MALLOC_ENV, tcmalloc_path

    lib = tcmalloc_path()
    code = ("import os, jax_tinybert.speed.malloc as m; e = os.environ.get; print(os.getpid(), "
            "e('MALLOC_ARENA_MAX'), e('MALLOC_MMAP_THRESHOLD_'), e('JTB_MALLOC_REEXEC'), "
            "e('LD_PRELOAD'), flush=True); m.restart_command()")

    def lines(**extra):
        env = dict(_env_without(*_MALLOC_VARS), **extra)
        r = subprocess.run([tiny_run.PYTHON, "-c", code], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [ln.split() for ln in r.stdout.splitlines()]

    first, again = lines()
    assert first[0] == again[0] and first[1:] == ["None", "None", "None", "None"]
    assert again[1:] == [MALLOC_ENV["MALLOC_ARENA_MAX"], MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"], "1",
                         str(lib)]
    assert [ln[1:] for ln in lines(JTB_MALLOC="off")] == [["None", "None", "None", "None"]]
    assert [ln[1:] for ln in lines(MALLOC_ARENA_MAX="4")] == [["4", "None", "None", "None"]]
    assert [ln[-1] for ln in lines(JTB_MALLOC="glibc")] == ["None", "None"]
    assert [ln[-1] for ln in lines(LD_PRELOAD="libm.so.6")] == ["libm.so.6", "libm.so.6"]
    assert [ln[-1] for ln in lines(JTB_TCMALLOC="/nonexistent/libtcmalloc.so")] == ["None", "None"]
    made = lines(**MALLOC_ENV)   # as `make demo` starts it
    assert [ln[-1] for ln in made] == (["None", str(lib)] if lib else ["None"])
    # What the Makefile's test target runs the suite under (`python -m jax_tinybert.speed.malloc
    # CMD`): the same variables; alone, the module prints them as KEY=VALUE lines.
    def printed(**extra):
        r = subprocess.run([tiny_run.PYTHON, "-m", "jax_tinybert.speed.malloc"], cwd=REPO,
                           env=dict(_env_without(*_MALLOC_VARS), **extra), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return dict(ln.split("=", 1) for ln in r.stdout.splitlines() if ln)
    tc = ({"LD_PRELOAD": lib, "TCMALLOC_RELEASE_RATE": "0",
           "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)} if lib else {})
    assert printed() == dict(MALLOC_ENV, **tc)
    assert printed(MALLOC_ARENA_MAX="4") == {}
    assert printed(**MALLOC_ENV) == tc   # as `make test` runs it
    show = "import os; print(os.environ.get('LD_PRELOAD'), os.environ.get('MALLOC_ARENA_MAX'))"
    r = subprocess.run([tiny_run.PYTHON, "-m", "jax_tinybert.speed.malloc", tiny_run.PYTHON, "-c",
                        show], cwd=REPO, env=_env_without(*_MALLOC_VARS), capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.split() == [str(lib), MALLOC_ENV["MALLOC_ARENA_MAX"]], r.stderr
    # Both entry points restart before their work (--help prints once, exit 0) and before
    # JAX is imported: with -X importtime (kept by the restart) only one process imports it.
    for entry in (["-m", "jax_tinybert.main"],
                  ["-c", "import sys; from jax_tinybert.cli import run; sys.exit(run())"]):
        r = subprocess.run([tiny_run.PYTHON, "-X", "importtime", *entry, "--help"], cwd=REPO,
                           env=_env_without(*_MALLOC_VARS), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and r.stdout.count("usage: ") == 1, (r.stdout, r.stderr[-2000:])
        jax_imports = [ln for ln in r.stderr.splitlines() if re.search(r"\|\s+jax$", ln)]
        assert len(jax_imports) == 1, (entry, jax_imports)


def test_tcmalloc_says_nothing_of_large_allocations_under_the_cli_settings():
    """Some tcmalloc builds print a line per allocation over 1 GiB (Colab's "tcmalloc: large
    alloc ..."; Debian's libtcmalloc-minimal4 does not); the settings the CLI restarts with
    raise that threshold out of reach: a run's output is for the user."""
    from jax_tinybert.speed import malloc

    lib = malloc.tcmalloc_path()
    if lib is None:
        pytest.skip("tcmalloc not installed (make install tries `apt-get install "
                    "libtcmalloc-minimal4`)")
    env = dict(_env_without(*_MALLOC_VARS), **malloc.wanted({}))
    assert env["LD_PRELOAD"] == lib and int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 2 ** 40
    assert env["TCMALLOC_RELEASE_RATE"] == "0"   # freed pages stay mapped, as glibc's do
    assert "TCMALLOC_RELEASE_RATE" not in malloc.wanted({"TCMALLOC_RELEASE_RATE": "2"})
    r = subprocess.run([tiny_run.PYTHON, "-c", "import numpy as np; a = np.ones(2 ** 28); "
                        "print(a.nbytes)"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)   # 2 GiB
    assert r.stdout.split() == [str(2 ** 31)] and r.stderr == "", r.stderr


def test_the_malloc_settings_load_without_jax_and_match_the_makefile():
    """Scripts restart with jax_tinybert.speed.malloc before JAX is loaded (glibc and XLA read their
    settings at start), so importing it (and the package) must not import JAX; make cannot import
    Python, so the Makefile's exported copy must hold the same values."""
    from jax_tinybert.speed.malloc import MALLOC_ENV

    r = subprocess.run([tiny_run.PYTHON, "-c", "import sys; from jax_tinybert import malloc, fs; "
                        "print(sorted(m for m in ('jax', 'flax', 'numpy') if m in sys.modules))"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["[]"], (r.stdout, r.stderr)
    exported = dict(re.findall(r"^export (MALLOC_\w+) := (\S+)$",
                               (pathlib.Path(REPO) / "Makefile").read_text(), re.M))
    assert exported == MALLOC_ENV


def test_a_gpu_or_tpu_host_gets_no_single_malloc_arena(tmp_path):
    """MALLOC_ENV (one arena, tuned for XLA's CPU steps) is not set where JAX may run on a GPU
    or TPU: there it only serialises the host's threads (the tokenizer ran 10x slower on a
    16-core H200 host). tcmalloc, where installed, is still preloaded; CPU runs are unchanged."""
    from jax_tinybert.speed import malloc, xla_flags

    no_tc = {"JTB_TCMALLOC": str(tmp_path / "none.so")}   # a named library that is not there
    assert malloc.wanted(dict(no_tc, JAX_PLATFORMS="cuda")) == {}
    assert malloc.wanted(dict(no_tc, JAX_PLATFORMS="tpu")) == {}
    assert malloc.wanted(dict(no_tc, JAX_PLATFORMS="cpu")) == malloc.MALLOC_ENV
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    assert malloc.wanted({"JTB_TCMALLOC": str(lib), "JAX_PLATFORMS": "cuda"}) == dict(
        malloc.TCMALLOC_ENV, LD_PRELOAD=str(lib))
    assert malloc.allocator({"JAX_PLATFORMS": "cuda"}).startswith("glibc defaults (a GPU/TPU")
    assert malloc.allocator({"JAX_PLATFORMS": "cpu"}) == "glibc defaults"
    # No JAX_PLATFORMS: libtpu installed (a TPU VM) decides, unless CPU devices are simulated.
    (tmp_path / "site" / "libtpu").mkdir(parents=True)
    site = [str(tmp_path / "site")]
    assert xla_flags.accelerator_possible({}, site)
    assert not xla_flags.accelerator_possible({"JTB_CPU_DEVICES": "8"}, site)
    assert not xla_flags.accelerator_possible({}, [str(tmp_path / "none")])


def test_a_cli_run_fills_the_default_compile_cache(cli, tmp_path):
    """With the defaults a user has: every program the run compiled is kept, the update and
    the evaluation's (each well under JAX's default 1 s threshold here) too."""
    d, _ = cli
    env = _env_without("JAX_COMPILATION_CACHE_DIR", "JTB_COMPILE_CACHE",
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", XDG_CACHE_HOME=str(tmp_path))
    args = _with(FINETUNE, [f"--workdir={tmp_path / 'run'}"])
    r = subprocess.run([tiny_run.PYTHON, "-m", "jax_tinybert.main", *args], cwd=d, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    names = {p.name.split("-")[0] for p in (tmp_path / "jax_tinybert" / "xla").iterdir()}
    assert {"jit_grads", "jit_update", "jit_eval_step"} <= names, names


def test_resume_refuses_a_changed_teacher_or_train_set_then_resumes(cli):
    """The same config, but the files it names changed since the run saved its steps: a teacher
    fine-tuned again in place, labels fixed in train.tsv. Going on would mix two teachers, or
    follow the saved data order over other examples; each is refused in one line naming what
    changed, and with the files put back the run resumes."""
    d, run = cli
    for src, dst in (("teacher", "teacher_i"), ("glue", "glue_i")):
        if not (d / dst).exists():
            shutil.copytree(d / src, d / dst)
    args = ["--config=configs/task_distill.py:sst2_intermediate", "--workdir=runs/i",
            "--config.teacher.path=teacher_i", "--config.data.glue_dir=glue_i",
            "--config.student.init=random", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
            "--config.student.num_attention_heads=4", *TINY]
    r = run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    longer = _with(args, ["--config.train.num_steps=4"])   # extends the run: resumes at step 2

    weights = d / "teacher_i" / "model.safetensors"
    original = weights.read_bytes()
    from safetensors.numpy import load_file, save_file
    t = load_file(str(weights))
    name = sorted(t)[0]
    t[name] = t[name] + np.asarray(0.01, t[name].dtype)   # "fine-tuned again": other weights
    save_file(t, str(weights), metadata={"format": "np"})
    _one_line_error(run(longer), "workdir runs/i holds a run distilled from other teacher "
                    "weights: the weights at config.teacher.path=teacher_i changed after step 2 "
                    "was saved", "Put the old weights back, use a new --workdir, or delete runs/i")
    weights.write_bytes(original)

    train = d / "glue_i" / "SST-2" / "train.tsv"
    text = train.read_text()
    header, *rows = text.splitlines()
    flipped = [r[:-1] + ("0" if r.endswith("1") else "1") for r in rows]   # every label
    train.write_text("\n".join([header, *flipped]) + "\n")
    _one_line_error(run(longer), "workdir runs/i holds a run trained on other data: the train "
                    "set (sst2 in glue_i) changed after step 2 was saved: the same number of "
                    "examples, other tokens or labels", "Put the old data back")
    train.write_text(text)

    r = run(longer)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in r.stdout


def test_a_full_disk_while_exporting_is_one_line_and_the_rerun_finishes(cli):
    """Out of space outside a checkpoint save (here the export at the end, after the last
    checkpoint): one line naming the file and the fix, exit 2; the same command then finishes
    from the saved step."""
    d, run = cli
    args = _with(FINETUNE, ["--workdir=runs/e"])
    boom = ("import errno, sys\n"
            "from jax_tinybert import main\n"
            "from jax_tinybert.train import evaluate\n"
            "def export_hf(*a, **k):\n"
            "    raise OSError(errno.ENOSPC, 'No space left on device', 'runs/e/export/x')\n"
            "evaluate.export_hf = export_hf\n"
            "sys.argv = ['jax-tinybert'] + sys.argv[1:]\n"
            "main.run()\n")
    r = run(["-c", boom, *args], module=None)
    _one_line_error(r, "error: no space left on the device ([Errno 28] No space left on device: "
                    "'runs/e/export/x'); free space there or move the workdir (or the cache "
                    "folder) to a larger disk, then rerun the same command: it resumes from the "
                    "last checkpoint")
    r = run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in r.stdout and (d / "runs" / "e" / "export").is_dir()


def test_a_finished_run_exits_after_its_atexit_handlers_with_its_output_flushed(cli):
    """A command that finished ends without the interpreter's teardown (main._exit_finished):
    the atexit handlers still run and what they print still comes out; the finalizers of the
    objects left are skipped. With another non-daemon thread still running, the process ends
    the normal way, once that thread is done."""
    d, run = cli
    script = ("import atexit, os, sys, threading, time\n"
              "from jax_tinybert import main\n"
              "class Finalized:\n"
              "    def __del__(self, _open=os.open, _close=os.close,\n"
              "                _flags=os.O_CREAT | os.O_WRONLY):\n"
              "        _close(_open('finalized', _flags))\n"
              "left = Finalized()\n"
              "atexit.register(lambda: sys.stdout.write('printed at exit, unflushed'))\n"
              "def late():   # still running when the command is done\n"
              "    while not os.path.exists(os.environ['LATE_THREAD']):\n"
              "        time.sleep(0.05)\n"
              "    time.sleep(0.5)\n"
              "    open('late', 'w').close()\n"
              "if os.environ.get('LATE_THREAD'):\n"
              "    threading.Thread(target=late).start()\n"
              "sys.argv = ['jax-tinybert'] + sys.argv[1:]\n"
              "main.run()\n")
    for name, late in (("fast", ""), ("late", "runs/exit_late/summary.json")):
        for f in ("finalized", "late"):
            (d / f).unlink(missing_ok=True)
        r = run(["-c", script, *_with(FINETUNE, [f"--workdir=runs/exit_{name}"])], module=None,
                LATE_THREAD=late)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "[finetune_teacher] done in" in r.stdout, r.stdout[-2000:]
        assert r.stdout.endswith("printed at exit, unflushed"), r.stdout[-300:]
        assert (d / "late").exists() == bool(late)
        # Finalizers run at a normal exit only: the one taken with a thread left.
        assert (d / "finalized").exists() == bool(late)


def test_a_diverging_run_stops_in_one_line_and_saves_no_nan(cli):
    """A learning rate far too high: the loss turns NaN between two logged steps. The run stops
    with one line naming the metric, the step and the fix, exit 2, and every checkpoint it
    left is finite (the step's check comes before its save, logged or not)."""
    d, run = cli
    args = _with(FINETUNE, ["--workdir=runs/nan", "--config.optim.learning_rate=1e4",
                            "--config.train.num_steps=30", "--config.train.log_every=100",
                            "--config.train.checkpoint_every=1", "--config.train.max_to_keep=30"])
    r = run(args)
    err = _one_line_error(r, "error: non-finite ", "nothing from this step on is saved (the "
                          "checkpoints so far are finite); rerun with a lower "
                          "config.optim.learning_rate (now 10000) in a new --workdir")
    bad_step = int(re.search(r"at step (\d+);", err).group(1))
    assert "loss=nan" in err and 1 < bad_step < 30, err
    steps = sorted(int(p.name) for p in (d / "runs" / "nan" / "checkpoints").iterdir()
                   if p.name.isdigit())
    assert steps and steps[-1] == bad_step - 1, (steps, bad_step)
    import jax

    leaves = jax.tree_util.tree_leaves(tiny_run.restore_state(d / "runs" / "nan", steps[-1]))
    floats = [np.asarray(x) for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]
    assert floats and all(np.isfinite(x).all() for x in floats)


def test_a_python_without_the_dependencies_gets_one_line_naming_the_venv(tmp_path):
    """The README's `python -m jax_tinybert.main` in a shell whose python is not the project's
    .venv: one line naming the missing package and the fix, exit 2, no traceback."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)
    r = subprocess.run([str(bare / "bin" / "python"), "-m", "jax_tinybert.main",
                        "--config=configs/finetune_teacher.py:sst2", "--workdir=runs/x"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: the Python package ") and "is not installed" in lines[0]
    assert "make install" in lines[0] and ". .venv/bin/activate" in lines[0]
    assert not (pathlib.Path(REPO) / "runs" / "x").exists()


def test_a_bfloat16_run_says_what_it_computes_and_tracks_float32(cli):
    """--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16 through the CLI on a
    CPU: the start-up line says bf16 products with float32 activations (the CPU path of
    build.compute_dtypes), and the first step's losses, before any update, are the float32
    run's to bf16 rounding (the float32 run is the reference)."""
    d, run = cli
    base = ["--config=configs/task_distill.py:sst2_intermediate",
            "--config.teacher.path=teacher", "--config.data.glue_dir=glue",
            "--config.student.init=random", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
            "--config.student.num_attention_heads=4", "--config.student.dropout=False",
            "--config.export.enabled=False", *TINY]
    losses = {}
    for dt in ("float32", "bfloat16"):
        r = run(base + [f"--workdir=runs/dtype_{dt}", f"--config.student.dtype={dt}",
                        f"--config.teacher.dtype={dt}"])
        assert r.returncode == 0, r.stderr[-3000:]
        says = "compute: bfloat16 products, float32 activations"
        assert (says in r.stdout) == (dt == "bfloat16"), r.stdout[-2000:]
        with open(d / "runs" / f"dtype_{dt}" / "metrics.jsonl") as fh:
            first = [json.loads(ln) for ln in fh if '"step": 1,' in ln][0]
        losses[dt] = {k: v for k, v in first.items() if k.startswith("train/")
                      and k.split("/")[1] not in ("lr", "examples_per_s", "tokens_per_s")}
    assert {"train/loss", "train/attn", "train/hidn", "train/embd", "train/grad_norm"} \
        <= set(losses["float32"]) and set(losses["float32"]) == set(losses["bfloat16"])
    for k, v in losses["float32"].items():
        assert np.isfinite(losses["bfloat16"][k])
        assert losses["bfloat16"][k] == pytest.approx(v, rel=2e-2), (k, losses)
    # The layers' products ran in bf16 (the embedding loss has none before its projection).
    assert all(losses["bfloat16"][k] != losses["float32"][k] for k in ("train/attn", "train/hidn"))
