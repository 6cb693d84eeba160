"""tools/plots.py: every plot from a full metrics file, and no failure on missing or broken keys."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from asyncrl import metric_names as names
from asyncrl import plots


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _full_records(n=12, eta=4):
    """The learner's, a worker's and the evaluation's records, by the names asyncrl emits."""
    recs = []
    for v in range(n):
        recs.append(
            {
                "step": v,
                "time": 100.0 + v,
                "process": "learner",
                names.STALENESS_MEAN: min(v, eta) / 2,
                names.STALENESS_MAX: min(v, eta),
                **{f"{names.STALENESS_HIST}{k}": float(k <= min(v, eta)) for k in range(eta + 1)},
                names.STALENESS_BOUND: eta,
                names.TRAINED_TOKENS_PER_S: 800.0,
                names.BATCH_WAIT_S: 0.1,
                names.WEIGHT_SYNC_S: 0.02,
                f"{names.PAUSE_S}127.0.0.1:30000": 0.001,
                names.DRIFT_MISMATCH: 1e-6,
                f"{names.DRIFT_BY_STALENESS}1": 1e-3,
                names.LOSS: 1.0 / (v + 1),
                names.GRAD_NORM: 0.5,
                names.BATCH_REWARD_MEAN: v / n,
                names.BATCH_RESPONSE_LENGTH_MEAN: 6.0,
                **_by_staleness(v, eta),
            }
        )
        recs.append(
            {
                "step": v,
                "process": "worker0",
                names.REWARD_MEAN: v / n,
                names.GENERATED_TOKENS_PER_S: 900.0 + v,
                names.GENERATOR_IDLE: 0.05,
            }
        )
    recs.append({"step": n, "process": "eval", names.EVAL_SUCCESS: 0.8})
    return recs


def _by_staleness(v: int, eta: int) -> dict[str, float]:
    """The learner's staleness view at version ``v``: tokens at staleness 0..min(v, eta), none
    older (the quantities only where there are tokens, as the learner logs them)."""
    out: dict[str, float] = {}
    for k in range(eta + 1):
        out[f"{names.STALENESS_TOKENS}{k}"] = 100.0 * (k <= min(v, eta))
        if k <= min(v, eta):
            out[f"{names.STALENESS_ESS}{k}"] = 1.0 - 0.1 * k
            out[f"{names.STALENESS_MASKED}{k}"] = 0.01 * k
            out[f"{names.STALENESS_CLIPPED}{k}"] = 0.02 * k
            out[f"{names.STALENESS_ADV_ABS}{k}"] = 0.5
            out[f"{names.STALENESS_REWARD}{k}"] = v / 12 - 0.02 * k
    return out


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
        "by_staleness.png",
        "learning.png",
    }
    for p in written:
        assert p.parent == tmp_path / "plots" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_keys_and_a_torn_last_line_are_not_errors(tmp_path):
    recs = [{"version": 0, names.REWARD_MEAN: 0.1}, {"step": 1, names.REWARD_MEAN: None, "x": "y"}]
    m = _write(tmp_path / "metrics.jsonl", recs, tail='{"version": 2, "rew')
    written = plots.make_plots(m, tmp_path / "out")
    assert [p.name for p in written] == ["reward.png"]


def test_series_reads_a_key_by_name_and_x_by_version():
    recs = [{"version": 5, names.GENERATOR_IDLE: 0.5}, {"foo": 1}, {"step": 7, "generator/idle": 1}]
    assert plots.series(recs, names.GENERATOR_IDLE) == ([5.0], [0.5])
    assert plots.series(recs, names.WEIGHT_SYNC_S) == ([], [])
    pauses = [{"step": 1, f"{names.PAUSE_S}b:2": 0.1, f"{names.PAUSE_S}a:1": 0.2, "x": 3}]
    assert plots.family(pauses, names.PAUSE_S) == [f"{names.PAUSE_S}a:1", f"{names.PAUSE_S}b:2"]
    drift = [{f"{names.DRIFT_BY_STALENESS}{k}": 0.1 for k in (10, 2, 1)}]
    assert plots.family(drift, names.DRIFT_BY_STALENESS) == [
        f"{names.DRIFT_BY_STALENESS}{k}" for k in (1, 2, 10)
    ]


def test_nested_records_are_flattened(tmp_path):
    m = _write(tmp_path / "m.jsonl", [{"version": 1, "staleness": {"mean": 1.0, "max": 2}}])
    assert plots.read_metrics(m) == [{"version": 1, "staleness/mean": 1.0, "staleness/max": 2}]


def test_cli_reports_a_missing_file(tmp_path, capsys):
    assert plots.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_staleness_heat_map_from_the_learners_records(tmp_path):
    from asyncrl.metrics import MetricsSink

    with MetricsSink(tmp_path, name="t", group="t", use_wandb=False) as sink:
        for v in range(4):
            hist = {f"{names.STALENESS_HIST}{k}": float(k <= min(v, 2)) for k in range(3)}
            sink.log({names.STALENESS_MEAN: v / 2, **hist}, step=v)
    assert [p.name for p in plots.make_plots(tmp_path / "metrics.jsonl")] == ["staleness.png"]


def test_learner_idle_is_derived_from_its_batch_waits():
    recs = [
        {"step": 1, "time": 100.0, "process": "learner", names.BATCH_WAIT_S: 5.0},
        {"step": 2, "time": 102.0, "process": "learner", names.BATCH_WAIT_S: 0.5},
        {"step": 2, "time": 102.5, "process": "worker0", names.REWARD_MEAN: 0.5},
        {"step": 3, "time": 106.0, "process": "learner", names.BATCH_WAIT_S: 3.0},
    ]
    assert plots.learner_idle_series(recs) == ([2.0, 3.0], [0.25, 0.75])


def test_a_run_with_a_critic_gets_its_plot_and_one_without_does_not(tmp_path):
    recs = _full_records()
    assert "critic.png" not in {
        p.name for p in plots.make_plots(_write(tmp_path / "a.jsonl", recs))
    }
    for r in recs:
        if r["process"] == "learner":
            v = r["step"]
            r |= {names.VALUE_LOSS: 1 / (v + 1), names.EXPLAINED_VARIANCE: v / 12}
            r[names.VALUE_CLIP_FRAC] = 0.1
    written = plots.make_plots(_write(tmp_path / "b.jsonl", recs), tmp_path / "b")
    (critic,) = [p for p in written if p.name == "critic.png"]
    assert critic.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _points(line) -> list[tuple[float, float]]:
    return list(zip(line.get_xdata(), line.get_ydata(), strict=True))


def test_the_reward_curve_has_every_step_and_evaluations_are_points_never_joined(tmp_path):
    """The learner's batch means at every step make the line; the worker's interval means and the
    held-out evaluations are points (a line between two evaluations 3 versions apart, or through
    two worker means at one version, would draw what was never measured); nothing is drawn where
    nothing was logged."""

    def step(v, reward, length):
        return {
            "step": v,
            "process": "learner",
            names.BATCH_REWARD_MEAN: reward,
            names.BATCH_RESPONSE_LENGTH_MEAN: length,
        }

    learner = [step(v, v / 10, 5.0 + v) for v in range(1, 7)]
    learner += [step(v, 0.9, 4.0) for v in (5, 6)]  # resumed at 4: 5 and 6 again, the last wins
    worker = [
        {"step": 0, "process": "worker0", names.GENERATED_TOKENS_PER_S: 1.0},  # nothing scored
        {"step": 3, "process": "worker0", names.REWARD_MEAN: 0.2},
        {"step": 3, "process": "worker0", names.REWARD_MEAN: 0.4},  # two intervals at version 3
    ]
    evals = [{"step": v, "process": "eval", names.EVAL_SUCCESS: s} for v, s in [(0, 0.1), (6, 0.7)]]
    records = plots.read_metrics(_write(tmp_path / "metrics.jsonl", learner + worker + evals))

    fig = plots.reward_figure(records)
    reward_ax, length_ax = fig.axes
    lines = {ln.get_label().split(":")[-1].strip(): ln for ln in reward_ax.get_lines()}
    every_step = lines.pop("trained batch, every step")
    assert _points(every_step) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.9), (6, 0.9)]
    assert every_step.get_linestyle() == "-"
    sampled, held_out = lines["sampled (worker, 10 s means)"], lines["held-out success (greedy)"]
    assert _points(sampled) == [(3, 0.2), (3, 0.4)] and sampled.get_linestyle() == "None"
    assert _points(held_out) == [(0, 0.1), (6, 0.7)] and held_out.get_linestyle() == "None"
    assert held_out.get_marker() == "o" and len(lines) == 2
    (length,) = length_ax.get_lines()
    assert _points(length) == [(1, 6.0), (2, 7.0), (3, 8.0), (4, 9.0), (5, 4.0), (6, 4.0)]
    plots._plt().close(fig)

    written = plots.make_plots(tmp_path / "metrics.jsonl")
    assert tmp_path / "plots/reward.png" in written
    assert (tmp_path / "plots/reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rm = plots.plot_reward_model(records, tmp_path / "plots")
    assert rm is not None and rm.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_distillation_run_plots_its_reverse_kl_under_the_learning_curves(tmp_path):
    """learning.png gets one more panel, the per-token reverse KL to the teacher, when the run
    logged it (algorithm.advantage: distill), and none otherwise (each panel is as tall)."""
    recs = _full_records()
    plain = plots.make_plots(_write(tmp_path / "a.jsonl", recs), tmp_path / "a")
    for r in recs:
        if r["process"] == "learner":
            r[names.DISTILL_REVERSE_KL] = 1.5 / (r["step"] + 1)
    distilled = plots.make_plots(_write(tmp_path / "b.jsonl", recs), tmp_path / "b")
    (a,) = [p for p in plain if p.name == "learning.png"]
    (b,) = [p for p in distilled if p.name == "learning.png"]
    with Image.open(a) as ia, Image.open(b) as ib:
        learner = next(r for r in recs if r["process"] == "learner")
        n = len([k for k in (names.LOSS, names.ENTROPY, names.GRAD_NORM) if k in learner])
        assert ia.width == ib.width and ib.height == pytest.approx(
            ia.height * (n + 1) / n, rel=0.02
        )


def test_a_distillation_summary_has_the_reverse_kl_of_its_first_and_last_versions():
    """summary.json's distill_reverse_kl_start/_end: the means over the first and the last 5
    versions, one value per version (a resumed learner's second record of a version wins)."""
    from asyncrl.summary import distill_summary

    recs = [{"step": v, names.DISTILL_REVERSE_KL: 2.0 - 0.2 * v} for v in range(1, 9)]
    recs.append({"step": 8, names.DISTILL_REVERSE_KL: 0.0})  # version 8 again, after a restart
    got = distill_summary(recs)
    assert got["distill_reverse_kl_start"] == pytest.approx((1.8 + 1.6 + 1.4 + 1.2 + 1.0) / 5)
    assert got["distill_reverse_kl_end"] == pytest.approx((1.2 + 1.0 + 0.8 + 0.6 + 0.0) / 5)
    assert distill_summary([]) == {"distill_reverse_kl_start": None, "distill_reverse_kl_end": None}


def test_an_moe_summary_has_the_routing_agreement_and_the_drift_kl():
    """summary.json of an MoE run: the routing agreement's mean over the run and over its first
    and last 5 versions, and the mean drift KL(μ ‖ π_prox), all tokens and staleness 0; one value
    per version (a resumed learner's second record of a version wins); None without routes (a run
    without replay asks for none)."""
    from asyncrl.summary import routing_summary

    recs = [
        {
            "step": v,
            names.ROUTING_AGREEMENT: 1.0 - 0.05 * v,
            names.DRIFT_KL: 0.01 * v,
            **({names.DRIFT_MISMATCH: 0.001} if v % 2 else {}),
        }
        for v in range(1, 9)
    ]
    recs.append({"step": 8, names.ROUTING_AGREEMENT: 0.0, names.DRIFT_KL: 0.0})  # a restart
    got = routing_summary(recs)
    assert got["routing_agreement_start"] == pytest.approx((0.95 + 0.9 + 0.85 + 0.8 + 0.75) / 5)
    assert got["routing_agreement_end"] == pytest.approx((0.8 + 0.75 + 0.7 + 0.65 + 0.0) / 5)
    agree = [1.0 - 0.05 * v for v in range(1, 8)] + [0.0]
    assert got["routing_agreement_mean"] == pytest.approx(sum(agree) / 8)
    assert got["drift_kl_mean"] == pytest.approx(0.01 * sum(range(1, 8)) / 8)
    assert got["mismatch_kl_mean"] == pytest.approx(0.001)
    without = routing_summary(
        [{k: v for k, v in r.items() if k != names.ROUTING_AGREEMENT} for r in recs]
    )
    assert without["routing_agreement_mean"] is None and without["drift_kl_mean"] is not None


def test_by_staleness_has_a_panel_per_quantity_and_a_line_per_staleness(tmp_path):
    """by_staleness.png: tokens, KL, ESS, masked-or-clipped, |A| and reward, one line per
    staleness k each; the KL's k = 0 is the engine mismatch (drift/mismatch_kl), a masked-or-clipped
    line the sum of the two fractions, and a k appears from the first version that trained it."""
    eta = 3
    recs = [{"step": v, "process": "learner", **_by_staleness(v, eta)} for v in range(1, 7)]
    for r in recs:
        r[names.DRIFT_MISMATCH] = 1e-6
        for k in range(1, min(r["step"], eta) + 1):
            r[f"{names.DRIFT_BY_STALENESS}{k}"] = 1e-3 * k
    records = plots.read_metrics(_write(tmp_path / "metrics.jsonl", recs))
    fig = plots.by_staleness_figure(records)
    panels = [ax.get_ylabel() for ax in fig.axes]
    assert panels == [label for label, _ in plots.STALENESS_PANELS] and len(panels) == 6
    by_label = dict(zip(panels, fig.axes, strict=True))
    for ax in fig.axes:
        assert [ln.get_label() for ln in ax.get_lines()] == [f"k = {k}" for k in range(eta + 1)]
    tokens = {ln.get_label(): _points(ln) for ln in by_label["trained tokens"].get_lines()}
    assert tokens["k = 0"] == [(v, 100.0) for v in range(1, 7)]
    assert tokens["k = 3"] == [(v, 100.0 * (v >= 3)) for v in range(1, 7)]
    kl = {ln.get_label(): _points(ln) for ln in by_label["KL(mu || pi_prox)"].get_lines()}
    assert kl["k = 0"] == [(v, 1e-6) for v in range(1, 7)]
    assert kl["k = 2"] == [(v, 2e-3) for v in range(2, 7)]
    assert by_label["KL(mu || pi_prox)"].get_yscale() == "log"
    cut = {ln.get_label(): _points(ln) for ln in by_label["masked or clipped"].get_lines()}
    assert cut["k = 2"] == [(v, pytest.approx(0.06)) for v in range(2, 7)]
    reward = {ln.get_label(): _points(ln) for ln in by_label["batch reward"].get_lines()}
    assert reward["k = 1"] == [(v, pytest.approx(v / 12 - 0.02)) for v in range(1, 7)]
    plots._plt().close(fig)
    written = plots.make_plots(tmp_path / "metrics.jsonl")
    assert tmp_path / "plots/by_staleness.png" in written
    assert (tmp_path / "plots/by_staleness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a run without the view (an SFT run, an older metrics file) has no such plot
    assert plots.by_staleness_figure(plots.read_metrics(_write(tmp_path / "b.jsonl", []))) is None
