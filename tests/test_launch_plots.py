"""tools/plots.py: every plot from a full metrics file, and no failure on missing or broken keys."""

from __future__ import annotations

import json

from asyncrl import plots


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _full_records(n=12, eta=4):
    recs = []
    for v in range(n):
        recs.append(
            {
                "version": v,
                "reward/mean": v / n,
                "staleness/mean": min(v, eta) / 2,
                "staleness/max": min(v, eta),
                **{f"staleness/hist/{k}": float(k <= min(v, eta)) for k in range(eta + 1)},
                "buffer/max_staleness": eta,
                "buffer/dropped_stale": 0,
                "throughput/generated_tokens_per_s": 900.0 + v,
                "throughput/trained_tokens_per_s": 800.0,
                "learner/idle_frac": 0.1,
                "generator/idle_frac": 0.05,
                "weights/sync_s": 0.02,
                "weights/pause_s/gen0": 0.001,
                "drift/mismatch_kl": 1e-6,
                "drift/staleness_kl/1": 1e-3,
                "loss": 1.0 / (v + 1),
                "grad_norm": 0.5,
            }
        )
    recs.append({"version": n, "eval/success": 0.8})
    return recs


def test_all_plots_from_full_metrics(tmp_path):
    m = _write(tmp_path / "metrics.jsonl", _full_records())
    written = plots.make_plots(m)
    names = {p.name for p in written}
    assert names == {
        "reward.png",
        "staleness.png",
        "throughput.png",
        "weight_sync.png",
        "drift.png",
        "learning.png",
    }
    for p in written:
        assert p.parent == tmp_path / "plots" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_keys_and_a_torn_last_line_are_not_errors(tmp_path):
    recs = [{"version": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": None, "text": "x"}]
    m = _write(tmp_path / "metrics.jsonl", recs, tail='{"version": 2, "rew')
    written = plots.make_plots(m, tmp_path / "out")
    assert [p.name for p in written] == ["reward.png"]


def test_series_picks_keys_by_pattern_and_x_by_version():
    recs = [{"version": 5, "rollout/generator_idle_fraction": 0.5}, {"foo": 1}]
    key, xs, ys = plots.series(recs, plots.GEN_IDLE)
    assert key == "rollout/generator_idle_fraction" and xs == [5.0] and ys == [0.5]
    assert plots.series(recs, plots.SYNC_S) == ("", [], [])


def test_nested_records_are_flattened(tmp_path):
    m = _write(tmp_path / "m.jsonl", [{"version": 1, "staleness": {"mean": 1.0, "max": 2}}])
    assert plots.read_metrics(m) == [{"version": 1, "staleness/mean": 1.0, "staleness/max": 2}]


def test_cli_reports_a_missing_file(tmp_path, capsys):
    assert plots.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_staleness_histograms_from_the_metrics_sink(tmp_path):
    from asyncrl.metrics import MetricsSink

    with MetricsSink(tmp_path, name="t", group="t", use_wandb=False) as sink:
        for v in range(4):
            sink.log({"staleness/mean": v / 2}, step=v)
            sink.log_histogram("staleness/hist", [0, 1, 1, min(v, 2)], step=v, bins=3)
    recs = plots.read_metrics(tmp_path / "metrics.jsonl")
    hist = next(r["staleness/hist"] for r in recs if "staleness/hist" in r)
    assert plots._hist_buckets(hist) == {0: 2.0, 1: 2.0}
    assert [p.name for p in plots.make_plots(tmp_path / "metrics.jsonl")] == ["staleness.png"]


def test_learner_idle_is_derived_from_batch_waits_when_not_logged():
    recs = [
        {"step": 1, "time": 100.0, "process": "learner", "buffer/wait_s": 5.0},
        {"step": 2, "time": 102.0, "process": "learner", "buffer/wait_s": 0.5},
        {"step": 2, "time": 102.5, "process": "worker0", "rollout/reward_mean": 0.5},
        {"step": 3, "time": 106.0, "process": "learner", "buffer/wait_s": 3.0},
    ]
    assert plots.learner_idle_series(recs) == ([2.0, 3.0], [0.25, 0.75])
    logged = [{"step": 1, "learner/idle_fraction": 0.1}]
    assert plots.learner_idle_series(logged) == ([1.0], [0.1])
