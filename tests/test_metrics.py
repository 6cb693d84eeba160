"""The metrics sink: JSONL lines every process can append to, and real W&B offline runs read back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from asyncrl.metrics import METRICS_FILE, MetricsSink, read_metrics, read_wandb_offline


def test_jsonl_lines_and_histograms_without_wandb(tmp_path):
    with MetricsSink(tmp_path, name="r", group="g", use_wandb=False, process="rollout-0") as sink:
        assert sink.wandb_run is None
        sink.log(
            {
                "loss": np.float32(0.25),
                "lengths": np.array([3, 4]),
                "note": "x",
                "grad_norm": torch.tensor(1.5),
                "per_rank": torch.tensor([1.0, 2.0]),
            },
            step=3,
        )
        sink.log_histogram("staleness", [0, 1, 1, 2, float("nan")], step=3, bins=2)
        sink.log_histogram("empty", [], step=4)
        with pytest.raises(ValueError, match="reserved"):
            sink.log({"step": 1}, step=1)
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [3, 3, 4]
    assert all(r["process"] == "rollout-0" and r["time"] > 0 for r in recs)
    assert recs[0]["loss"] == 0.25 and recs[0]["lengths"] == [3, 4] and recs[0]["note"] == "x"
    assert recs[0]["grad_norm"] == 1.5 and recs[0]["per_rank"] == [1.0, 2.0]
    assert recs[1]["staleness"] == {"hist": [1, 3], "edges": [0.0, 1.0, 2.0]}  # NaN left out
    assert recs[2]["empty"] == {"hist": [], "edges": []}
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(RuntimeError, match="closed"):
        sink.log({"loss": 1.0}, step=5)


def test_wandb_mode_env_disabled_keeps_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with MetricsSink(tmp_path, name="r", group="g") as sink:
        assert sink.wandb_run is None
        sink.log({"a": 1}, step=0)
    assert read_metrics(tmp_path)[0]["a"] == 1
    assert not (tmp_path / "wandb").exists()


def test_read_metrics_filters_process_and_skips_a_torn_last_line(tmp_path):
    lines = [
        {"step": 0, "time": 1.0, "process": "learner", "a": 1},
        {"step": 0, "time": 1.0, "process": "rollout-1", "b": 2},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 1, "ti'
    (tmp_path / METRICS_FILE).write_text(text)
    assert read_metrics(tmp_path) == lines
    assert read_metrics(tmp_path, process="rollout-1") == lines[1:]
    (tmp_path / METRICS_FILE).write_text("garbage\n" + text)
    with pytest.raises(ValueError, match=":1: not a JSON line"):
        read_metrics(tmp_path)
    assert read_metrics(tmp_path / "nothing") == []


def test_processes_append_to_one_file_without_tearing_lines(tmp_path):
    """Two real processes write 300 long lines each at once; every line comes back whole."""
    script = textwrap.dedent(
        """
        import sys
        from asyncrl.metrics import MetricsSink
        with MetricsSink(sys.argv[1], name="r", group="g", use_wandb=False, process=sys.argv[2]) as s:
            for i in range(300):
                s.log({"i": i, "pad": "x" * 3000}, step=i)
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path), f"rollout-{k}"])
        for k in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    recs = read_metrics(tmp_path)
    assert len(recs) == 600
    for k in range(2):
        assert [r["i"] for r in recs if r["process"] == f"rollout-{k}"] == list(range(300))


def test_wandb_offline_runs_of_one_group_read_back(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = {"learner": {"lr": 1e-6}, "buffer": {"max_staleness": 1}}
    learner = MetricsSink(tmp_path, name="exp", group="exp", config=config)
    rollout = MetricsSink(tmp_path, name="exp", group="exp", config=config, process="rollout-0")
    try:
        # Out-of-order steps across (and within) processes: W&B's x-axis is our "step" metric.
        rollout.log({"reward": 0.5}, step=2)
        learner.log({"loss": 1.5, "lr": 1e-6}, step=1)
        learner.log_histogram("staleness", [0, 0, 1], step=1, bins=2)
        rollout.log({"reward": 0.75}, step=1)
    finally:
        learner.close()
        rollout.close()
    runs = {r["job_type"]: r for r in read_wandb_offline(tmp_path)}
    assert set(runs) == {"learner", "rollout-0"}
    assert {r["group"] for r in runs.values()} == {"exp"}
    assert runs["learner"]["name"] == "exp" and runs["rollout-0"]["name"] == "exp-rollout-0"
    assert runs["learner"]["config"]["learner"] == {"lr": 1e-6}
    hist = runs["learner"]["history"]
    assert [(h["step"], h.get("loss")) for h in hist] == [(1, 1.5), (1, None)]
    assert hist[1]["staleness/values"] == [2, 1] and hist[1]["staleness/bins"] == [0, 0.5, 1]
    assert [(h["step"], h["reward"]) for h in runs["rollout-0"]["history"]] == [(2, 0.5), (1, 0.75)]
    # The same numbers are in the JSONL file.
    jsonl = read_metrics(tmp_path, process="learner")
    assert jsonl[0]["loss"] == 1.5 and jsonl[1]["staleness"]["hist"] == [2, 1]
