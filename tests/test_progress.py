"""jax_tinybert.progress: bars on a terminal, periodic plain lines with rate and ETA in a log."""
import io

import numpy as np

from jax_tinybert import progress
from jax_tinybert.teacher import cache as teacher_cache


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_have_count_rate_eta(monkeypatch):
    clock = iter(np.arange(0.0, 100.0, 2.0))   # each perf_counter call: +2 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(clock)))
    out = io.StringIO()
    with progress.Progress("tokenize SST-2", total=1000, unit="ex", stream=out, every_s=1,
                           enabled=True) as p:
        for _ in range(4):
            p.update(100)
    lines = out.getvalue().splitlines()
    # t0 = 0; updates at t = 2, 4, 6, 8 -> 100/2 s = 50 ex/s, 900 left -> ETA 18s
    assert lines[0] == "[tokenize SST-2] 100/1,000 ex (10%) 50 ex/s, ETA 18s", lines
    assert lines[3] == "[tokenize SST-2] 400/1,000 ex (40%) 50 ex/s, ETA 12s", lines
    # closing line at t = 10: 400 ex in 10 s
    assert lines[4] == "[tokenize SST-2] 400 ex in 10s (40 ex/s)", lines
    assert p.rate == 40.0 and p.elapsed == 10.0


def test_a_phase_ended_by_an_exception_says_it_stopped(monkeypatch):
    """Ctrl-C or an error inside the phase: the closing line must not read like a finished
    phase ("64 ex in 2s"), even a short one."""
    t = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: t[0])
    out = io.StringIO()
    try:
        with progress.Progress("teacher cache", total=256, unit="ex", stream=out, every_s=100,
                               enabled=True) as p:
            t[0] = 0.5
            p.update(64)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue().splitlines() == ["[teacher cache] stopped after 64 of 256 ex in 0s"]
    for kw, n, line in ((dict(total=20_000_000, unit="B"), 1_000_000,
                         "[x] stopped after 1.0 MB of 20.0 MB in 0s"),
                        (dict(unit="ex"), 64, "[x] stopped after 64 ex in 0s")):
        out = io.StringIO()
        p = progress.Progress("x", stream=out, every_s=100, enabled=True, **kw)
        p.update(n)
        p.close(stopped=True)
        assert out.getvalue().splitlines() == [line]


def test_plain_lines_are_periodic_and_bytes_are_scaled(monkeypatch):
    t = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: t[0])
    out = io.StringIO()
    p = progress.Progress("pack corpus", total=20_000_000, unit="B", stream=out, every_s=10,
                          enabled=True)
    for i in range(1, 31):          # one update per second for 30 s
        t[0] = float(i)
        p.set(i * 100_000)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines   # at 10 s, 20 s, 30 s + the closing line
    assert lines[0] == "[pack corpus] 1.0 MB/20.0 MB (5%) 100.0 kB/s, ETA 3m10s", lines
    assert lines[-1] == "[pack corpus] 3.0 MB in 30s (100.0 kB/s)", lines


def test_unknown_total_no_eta_and_quiet_short_phase():
    out = io.StringIO()
    with progress.Progress("eval", unit="batch", stream=out, every_s=0, enabled=True) as p:
        p.update(3)
    text = out.getvalue()
    assert "ETA" not in text and "%" not in text and "batch/s" in text, text
    assert "in " not in text  # under a second: no closing line


def test_tty_gets_a_tqdm_bar():
    out = _Tty()
    with progress.Progress("teacher cache", total=50, unit="ex", stream=out, enabled=True) as p:
        p.update(50)
    text = out.getvalue()
    assert "teacher cache" in text and "50/50" in text and "ex/s" in text, text


def test_disabled_and_other_processes_write_nothing(monkeypatch):
    out = io.StringIO()
    with progress.Progress("x", total=10, stream=out, every_s=0, enabled=False) as p:
        p.update(10)
    monkeypatch.setenv("JTB_PROCESS_ID", "1")
    monkeypatch.setattr(progress.sys, "modules", {k: v for k, v in progress.sys.modules.items()
                                                  if k != "jax"})
    q = progress.Progress("x", total=10, stream=out, every_s=0)
    q.update(10)
    q.close()
    assert out.getvalue() == "" and not q.enabled and p.rate > 0


def test_track_counts_items():
    out = io.StringIO()
    items = list(progress.track(range(7), "batches", stream=out, every_s=0, enabled=True))
    assert items == list(range(7))
    assert out.getvalue().splitlines()[-1].startswith("[batches] 7 ex"), out.getvalue()


def test_teacher_cache_build_reports_progress_and_rate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JTB_PROGRESS_EVERY_S", "0")
    n = 10

    def forward(params, ids, mask, types):
        return {"teacher_logits": np.asarray(ids[:, :2], np.float32) * params}

    batches = [{"example_id": np.arange(i, i + 5), "input_ids": np.ones((5, 4), np.int32) * i,
                "attention_mask": np.ones((5, 4), np.int32),
                "token_type_ids": np.zeros((5, 4), np.int32)} for i in (0, 5)]
    cache = teacher_cache.build(str(tmp_path / "c"), {"t": 1}, forward, np.float32(2.0),
                                batches, n)
    err = capsys.readouterr().err
    assert "[teacher cache] 5/10 ex (50%)" in err and "[teacher cache] 10/10 ex (100%)" in err, err
    assert cache.build_stats["examples_per_s"] > 0 and cache.build_stats["seconds"] >= 0
    np.testing.assert_array_equal(cache.lookup([7])["teacher_logits"], [[10.0, 10.0]])  # batch 5..9: ids 5 x 2


def test_percentage_and_eta_follow_the_work(monkeypatch):
    """Units of unequal work (a packed teacher pass forwards its long examples first): after 10
    of 100 examples that were 50% of the work in 4 s, the line says 50% and ETA 4s (by hand), not
    the 36 s that the examples' rate would give."""
    t = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: t[0])
    out = io.StringIO()
    p = progress.Progress("teacher cache", total=100, unit="ex", stream=out, every_s=0,
                          enabled=True, bar=False, work_total=200.0)
    t[0] = 4.0
    p.update(10, work=100.0)
    assert out.getvalue().splitlines()[-1] == \
        "[teacher cache] 10/100 ex, 50% of the work, 2.5 ex/s, ETA 4s", out.getvalue()
    t[0] = 6.0
    p.update(90, work=100.0)
    assert out.getvalue().splitlines()[-1] == \
        "[teacher cache] 100/100 ex, 100% of the work, 17 ex/s, ETA 0s", out.getvalue()
    p.close()
    assert out.getvalue().splitlines()[-1] == "[teacher cache] 100 ex in 6s (17 ex/s)"


def test_a_bar_with_work_shows_the_work_and_the_counts():
    out = io.StringIO()
    with progress.Progress("teacher cache", total=10, unit="ex", stream=out, enabled=True,
                           bar=True, work_total=40.0) as p:
        p.update(2, work=30.0)
        assert p._bar.n == 30.0 and p._bar.total == 40.0
        p.update(8, work=10.0)
    assert "100%" in out.getvalue() and "10/10 ex" in out.getvalue(), out.getvalue()
