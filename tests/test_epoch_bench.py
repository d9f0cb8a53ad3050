"""benchmarks/epoch.py's arithmetic: epoch ratios, targets, the table (no timing here)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import epoch  # noqa: E402


def _result():
    run = lambda wall, steps: {"wall_s": wall, "cpu_s": 2 * wall, "steps": steps,  # noqa: E731
                               "marks": {"setup_done": 10.0, "first_step": 30.0,
                                         "last_step": wall - 5.0}, "load_before": 2.0,
                               "load_after": 2.5}
    step_rows = [{"stage": "tinybert_pred", "s_per_step": 0.5, "torch_s_per_step": 0.6,
                  "gflop_per_step": 100.0},
                 {"stage": "tinybert_intermediate", "s_per_step": 1.0, "torch_s_per_step": 0.9,
                  "gflop_per_step": 110.0},
                 {"stage": "finetune", "s_per_step": 0.8, "torch_s_per_step": 2.0,
                  "gflop_per_step": 140.0}]
    peak = {"jax_flop_s": 150e9, "torch_flop_s": 250e9}
    return {"date": "d", "command": "c", "machine": {"cpu": "cpu", "nproc": 2},
            "load_start": 1.0, "load_end": 1.0,
            "tasks": {"sst2": {"num_train": 3200, "train_subset": 3200, "seq": 64,
                               "official": [{"prediction": 0.8, "intermediate": 0.9},
                                            {"prediction": 1.0, "intermediate": 1.1}],
                               "step_bench": [{"results": step_rows, "matmul_peak": peak}],
                               "ours": {"finetune": run(100.0, 100), "intermediate": run(20.0, 99),
                                        "intermediate_later": run(10.0, 99),
                                        "pred": run(25.0, 99),
                                        "pred_standalone": run(45.0, 99)}}}}


def test_epoch_ratios_use_the_official_epoch_and_the_mean_of_both_timings():
    rows = {(r["what"], r["ref_detail"].split(":")[0]): r for r in epoch.summarise(_result())}
    pred = rows[("epoch: prediction (after the intermediate stage)", "official")]
    assert pred["ref_s"] == pytest.approx(100 * 0.9)  # 3200 // 32 steps x mean(0.8, 1.0)
    assert pred["ratio"] == pytest.approx(90 / 25)
    alone = rows[("epoch: prediction, standalone", "official")]
    assert alone["ratio"] == pytest.approx(90 / 45) and alone["target"] == 6.0
    inter = rows[("epoch: intermediate, 1st epoch", "official")]
    assert inter["ratio"] == pytest.approx(100 * 1.0 / 20) and inter["target"] == 3.0
    assert rows[("epoch: intermediate, later epoch", "official")]["ratio"] == pytest.approx(10.0)
    ft = rows[("epoch: teacher fine-tuning", "plain PyTorch loop")]
    assert ft["ratio"] == pytest.approx(100 * 2.0 / 100) and ft["target"] == 2.0
    # Per step: official mean / ours; % of the best matmul of any library (torch's here).
    assert rows[("step pred, T=64", "official")]["ratio"] == pytest.approx(0.9 / 0.5)
    pct = rows[("step pred, T=64: % of best matmul", "best fp32 matmul 250 GFLOP/s")]
    assert pct["ratio"] == pytest.approx(100 * (100e9 / 0.5) / 250e9)


def test_render_marks_targets_met_and_missed():
    table = epoch.render(_result())
    line = next(x for x in table.splitlines() if "epoch: prediction (after" in x)
    assert "3.60x" in line and ">= 6x" in line and line.endswith("**no** |")
    line = next(x for x in table.splitlines() if "later epoch" in x)
    assert "10.00x" in line and line.endswith("yes |")
    assert "sst2 pred: 25 s wall" in table


def test_render_shows_the_decimals_that_tell_a_miss_from_the_target():
    res = _result()
    rows = res["tasks"]["sst2"]["step_bench"][0]["results"]
    rows[2]["gflop_per_step"] = 0.8 * 0.596 * 250.0   # finetune at 59.6% of 250 GFLOP/s
    rows[0]["torch_s_per_step"] = 0.5 * 0.9996         # pred 0.9996x the PyTorch reference
    table = epoch.render(res).splitlines()
    line = next(x for x in table if "step finetune, T=64: % of best matmul" in x)
    assert "| 59.6% |" in line and line.endswith("**no** |")
    line = next(x for x in table if "step pred, T=64" in x and "PyTorch reference" in x)
    assert "| 0.9996x |" in line and line.endswith("**no** |")
    line = next(x for x in table if "step pred, T=64: % of best matmul" in x)
    assert "| 80% |" in line and line.endswith("yes |")   # 200 GFLOP/s of 250: as before
    assert epoch._shown(60.04, 60.0, 0) == "60" and epoch._shown(3.0, 3.0, 2) == "3.00"


def test_two_epoch_run_splits_at_the_logged_step_times():
    # 100 steps per epoch; steps logged every 50 from t=40 s (after start-up, cache, compile),
    # 0.5 s a step in epoch 1 and 0.3 s in epoch 2; 12 s of checkpoint + export after step 200.
    marks = [(50, 40.0), (100, 65.0), (150, 80.0), (200, 95.0)]
    r = {"wall_s": 107.0, "cpu_s": 214.0, "steps": 200, "step_marks": marks, "marks": {}}
    first, later = epoch.split_epochs(r)
    assert later["wall_s"] == pytest.approx(30.0) and later["steps"] == 100
    assert first["wall_s"] == pytest.approx(77.0) and first["steps"] == 100
    assert first["cpu_s"] + later["cpu_s"] == pytest.approx(214.0)
    assert "steps 101-200" in later["detail"]
    assert epoch._time_at_step(marks, 75) == pytest.approx(52.5)  # interpolated
    with pytest.raises(ValueError, match="outside"):
        epoch._time_at_step(marks, 250)


def test_split_epochs_have_their_own_phases():
    marks = [(1, 30.0), (50, 40.0), (100, 65.0), (150, 80.0), (200, 95.0)]
    r = {"wall_s": 107.0, "cpu_s": 214.0, "steps": 200, "step_marks": marks,
         "marks": {"setup_done": 20.0, "cache_start": 5.0, "first_step": 30.0, "last_step": 95.0},
         "load_before": 1.0, "load_after": 1.0}
    first, later = epoch.split_epochs(r)
    assert sum(first["phases"].values()) == pytest.approx(first["wall_s"])
    assert first["phases"]["final checkpoint, export, exit"] == pytest.approx(12.0)
    res = _result()
    res["tasks"]["sst2"]["ours"].update(intermediate=first, intermediate_later=later)
    table = epoch.render(res)
    line = next(x for x in table.splitlines() if x.startswith("- sst2 intermediate_later"))
    assert line.endswith("= steps 101-200 30 s (load 1.0 -> 1.0)")
    line = next(x for x in table.splitlines() if x.startswith("- sst2 intermediate:"))
    assert "teacher cache 20 s" in line and "final checkpoint, export, exit 12 s" in line
    # The teacher pass beside the steps (its closing line after the first step): not set-up.
    r["marks"].update(cache_start=25.0, cache_done=52.4)
    first, _ = epoch.split_epochs(r)
    assert "start-up, data, models (the teacher cache pass beside the steps, done at 52 s)" \
        in first["phases"]


# The lines of a real MRPC intermediate run, as the CLI prints them.
TEACHER_LINE = "[teacher cache] 3,668 ex in 34s (108 ex/s; 5.40 TFLOP, 159 GFLOP/s)"
AHEAD_LINE = ("I1127 13:37:18.599804 140041036584896 train.py:136] compiled ahead: update step 1 "
              "of 1 programs (113 of 113 calls; 0.9 s; 34.87 GFLOP), gradient step 3 of 3 "
              "programs (113 of 113 calls; 1.6 1.2 1.3 s; 7.66 TFLOP); the others compiled in "
              "the step that first needed them")


def test_work_is_read_from_the_runs_lines():
    w = epoch.parse_work("step 1/113 loss=1", None)
    assert w is None
    w = epoch.parse_work(TEACHER_LINE, w)
    w = epoch.parse_work(AHEAD_LINE, w)
    assert w["teacher_pass"] == pytest.approx(5.40e12)
    assert w["steps"] == pytest.approx(7.66e12 + 34.87e9) and w["complete"]
    # A step that compiled some programs in the step: its calls there are not counted.
    partial = AHEAD_LINE.replace("gradient step 3 of 3 programs (113 of 113",
                                 "gradient step 2 of 3 programs (100 of 113")
    assert not epoch.parse_work(partial, None)["complete"]
    # A program without a count (an accelerator whose cost analysis gives none).
    assert not epoch.parse_work(AHEAD_LINE.replace("; 34.87 GFLOP", ""), None)["complete"]
    # A step that never ran (eval, stopped before its first evaluation) has nothing to count.
    idle = AHEAD_LINE.replace("; the others", ", eval step 0 of 0 programs (0 of 0 calls; 0.8 "
                              "0.8 s); the others")
    assert epoch.parse_work(idle, None)["complete"]


def test_ceiling_is_the_reference_over_the_work_at_the_best_matmul_rate():
    res = _result()
    ours = res["tasks"]["sst2"]["ours"]
    # 3 TFLOP in the 45 s standalone epoch; the best matmul 250 GFLOP/s (torch's here): at that
    # rate the work takes 12 s, the official epoch 90 s: ceiling 7.5x; it ran at 3e12/45/250e9.
    ours["pred_standalone"]["work"] = {"teacher_pass": 1e12, "steps": 2e12, "complete": True}
    ours["pred"]["work"] = {"teacher_pass": 0.0, "steps": 2e12, "complete": False}
    rows = {r["what"]: r for r in epoch.summarise(res) if r["what"].startswith("epoch")}
    alone = rows["epoch: prediction, standalone"]
    assert alone["ceiling"] == pytest.approx(90 / 12)
    assert alone["pct_of_peak"] == pytest.approx(100 * 3e12 / 45 / 250e9)
    assert "ceiling" not in rows["epoch: prediction (after the intermediate stage)"]
    table = epoch.render(res)
    line = next(x for x in table.splitlines() if "prediction, standalone" in x)
    assert "| 7.50x (3.00 TFLOP, run at 27%) | **no** |" in line
    line = next(x for x in table.splitlines() if x.startswith("- sst2 pred_standalone:"))
    assert "work 3.00 TFLOP (teacher pass 1.00, steps 2.00)" in line
    line = next(x for x in table.splitlines() if x.startswith("- sst2 pred:"))
    assert "work 2.00 TFLOP (steps 2.00; some calls not counted)" in line


def test_two_epoch_run_shares_its_steps_work_between_the_epochs():
    marks = [(50, 40.0), (100, 65.0), (150, 80.0), (200, 95.0)]
    r = {"wall_s": 107.0, "cpu_s": 214.0, "steps": 200, "step_marks": marks, "marks": {},
         "work": {"teacher_pass": 5e12, "steps": 8e12, "complete": True}}
    first, later = epoch.split_epochs(r)
    assert first["work"] == {"teacher_pass": 5e12, "steps": 4e12, "complete": True}
    assert later["work"] == {"teacher_pass": 0.0, "steps": 4e12, "complete": True}


def test_epochs_compare_with_the_official_step_timed_on_their_two_sides():
    """With the official step also timed between our processes (--paired_steps), each epoch's
    reference is the mean of the timings just before and just after its process, not of the
    run's first and last: a host that drifts 30% in 20 minutes misstates a ratio otherwise."""
    res = _result()
    t = res["tasks"]["sst2"]   # start 0.8 / 0.9, end 1.0 / 1.1 (prediction / intermediate)
    t["order"] = ["finetune", "intermediate", "pred", "pred_standalone"]
    t["official_paired"] = [{"before": "intermediate", "prediction": 2.0, "intermediate": 3.0},
                            {"before": "pred", "prediction": 4.0, "intermediate": 5.0},
                            {"before": "pred_standalone", "prediction": 6.0, "intermediate": 7.0}]
    rows = {(r["what"], r["ref_detail"].split(":")[0]): r for r in epoch.summarise(res)}
    inter = rows[("epoch: intermediate, 1st epoch", "official")]
    assert inter["ref_s"] == pytest.approx(100 * (3.0 + 5.0) / 2)   # before / after its process
    assert "timed 3.000 s before and 5.000 s after it" in inter["ref_detail"]
    later = rows[("epoch: intermediate, later epoch", "official")]   # the same process
    assert later["ref_s"] == pytest.approx(400.0) and later["ratio"] == pytest.approx(40.0)
    assert rows[("epoch: prediction (after the intermediate stage)", "official")]["ref_s"] == \
        pytest.approx(100 * (4.0 + 6.0) / 2)
    alone = rows[("epoch: prediction, standalone", "official")]   # the last: the end's timing
    assert alone["ref_s"] == pytest.approx(100 * (6.0 + 1.0) / 2)
    # The fine-tuning reference (PyTorch) and the per-step rows keep the start / end means.
    assert rows[("epoch: teacher fine-tuning", "plain PyTorch loop")]["ratio"] == \
        pytest.approx(2.0)
    assert rows[("step pred, T=64", "official")]["ratio"] == pytest.approx(0.9 / 0.5)
    table = epoch.render(res)
    assert ("sst2: the official step over the run (start, before intermediate, before pred, "
            "before pred_standalone, end): prediction 0.800 / 2.000 / 4.000 / 6.000 / 1.000 s, "
            "intermediate 0.900 / 3.000 / 5.000 / 7.000 / 1.100 s") in table
    # Timings that do not fit the processes (an interrupted run) fall back to the mean of all.
    t["official_paired"] = t["official_paired"][:1]
    rows = {(r["what"], r["ref_detail"].split(":")[0]): r for r in epoch.summarise(res)}
    assert rows[("epoch: prediction (after the intermediate stage)", "official")]["ref_s"] == \
        pytest.approx(90.0)


def test_the_official_step_is_timed_before_every_process_but_the_first(tmp_path, monkeypatch):
    """main() and run_ours(): the official step between our processes, tagged with the process
    that follows; our processes in the order run (no CLI, no official code: both faked)."""
    calls, ran = [], []

    def fake_official(args, seq, steps=None, warmup=None):
        calls.append((steps, list(ran)))
        return {"prediction": 1.0 + len(calls), "intermediate": 2.0 + len(calls)}

    def fake_cli(config, workdir, overrides, log_path, env=None):
        ran.append(config.split(":")[-1] + ("+" if env else ""))
        steps = 224 if "intermediate" in config else 113
        return {"wall_s": 100.0, "cpu_s": 190.0, "steps": steps, "marks": {},
                "step_marks": [(1, 5.0), (steps, 95.0)], "load_before": 2.0,
                "load_after": 2.0}

    official = tmp_path / "TinyBERT"
    (official / "transformer").mkdir(parents=True)
    monkeypatch.setattr(epoch, "official_steps", fake_official)
    monkeypatch.setattr(epoch, "prepare_official", lambda args: None)
    monkeypatch.setattr(epoch, "run_cli", fake_cli)
    monkeypatch.setattr(epoch, "render", lambda res: "")
    out = tmp_path / "r.json"
    epoch.main(["--tasks", "mrpc", "--official_dir", str(official), "--no_step_bench",
                "--scratch", str(tmp_path / "s"), "--json", str(out), "--paired_steps", "3"])
    import json
    t = json.loads(out.read_text())["tasks"]["mrpc"]
    assert t["order"] == ["finetune", "intermediate", "pred", "pred_standalone"]
    assert [p["before"] for p in t["official_paired"]] == ["intermediate", "pred",
                                                          "pred_standalone"]
    assert calls == [(None, []), (3, ["mrpc"]), (3, ["mrpc", "mrpc_intermediate"]),
                     (3, ["mrpc", "mrpc_intermediate", "mrpc_pred"]),
                     (None, ["mrpc", "mrpc_intermediate", "mrpc_pred", "mrpc_pred+"])]
    assert len(t["official"]) == 2


@pytest.mark.parametrize("argv,msg", [
    (["--official_dir", "/no/such/TinyBERT"], "--official_dir /no/such/TinyBERT: no transformer/ "
                                              "folder (pass the official repository's TinyBERT folder)"),
    (["--glue_dir", "/no/such/glue"], "--glue_dir /no/such/glue: no /no/such/glue/MRPC/train.tsv "
                                      "(pass the folder holding MRPC/train.tsv and dev.tsv"),
])
def test_wrong_folders_are_refused_before_anything_runs(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        epoch.main(["--tasks", "mrpc", "--scratch", str(tmp_path / "s"), *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
