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
