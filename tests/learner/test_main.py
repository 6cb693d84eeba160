"""`asyncrl learner` as a process: SIGTERM finishes the step, checkpoints, exports and exits 0 (the
launcher relies on it), and the run resumes from there; user mistakes are one-line errors, exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from asyncrl import tasks
from asyncrl.metrics import read_metrics


def write_recipe(path, model_dir, data, out, **learner):
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "r", "output_dir": str(out), "steps": 100_000},
                "model": {"path": str(model_dir), "max_seq_len": 32},
                "data": {"path": str(data)},
                "algorithm": {"loss": "sft"},
                "learner": {"batch_size": 8, "checkpoint_every": 0, **learner},
                "logging": {"wandb": False},
            }
        )
    )
    return path


def errors(capsys) -> list[str]:
    """The learner's error lines (library warnings may precede them); never a traceback."""
    text = capsys.readouterr().err
    assert "Traceback" not in text
    return [line for line in text.splitlines() if line.startswith("asyncrl learner:")]


def test_sigterm_checkpoints_and_the_run_resumes(tiny_qwen3, tmp_path, capsys):
    train, _ = tasks.write_task("reverse", tmp_path / "data", train=64, eval=4)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_qwen3, train, tmp_path / "runs")
    run = tmp_path / "runs" / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncrl.cli", "learner", str(recipe)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 2):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the learner logged no steps in 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    last = read_metrics(run)[-1]["step"]
    assert (run / "checkpoints" / f"step-{last}" / ".metadata").is_file()
    assert json.loads((run / "hf" / f"v{last}" / "config.json").read_text())["model_type"]

    from asyncrl.learner.main import main

    # the same run without run.resume is refused (it would silently continue otherwise)
    assert main([str(recipe), f"run.steps={last + 1}"]) == 2
    err = errors(capsys)
    assert len(err) == 1 and "run.resume=true" in err[0]
    assert main([str(recipe), f"run.steps={last + 1}", "run.resume=true"]) == 0
    assert [m["step"] for m in read_metrics(run)][-2:] == [last, last + 1]


def test_user_mistakes_are_one_line_errors(tiny_qwen3, tmp_path, capsys):
    from asyncrl.learner.main import main

    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err

    bad_model = tmp_path / "gpt2"
    bad_model.mkdir()
    (bad_model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    recipe = write_recipe(tmp_path / "r.yaml", bad_model, data, tmp_path / "runs")
    assert main([str(recipe)]) == 2
    err = errors(capsys)
    assert len(err) == 1 and "model_type 'gpt2' is not supported" in err[0]

    data.write_text(json.dumps({"question": "a", "completion": "b"}) + "\n")
    recipe = write_recipe(tmp_path / "r2.yaml", tiny_qwen3, data, tmp_path / "runs2")
    assert main([str(recipe)]) == 2
    err = errors(capsys)
    assert len(err) == 1 and "row 1 has no 'prompt'" in err[0]


@pytest.mark.slow
def test_a_wait_for_a_batch_with_every_generator_dropped_ends_with_the_cause(tiny_qwen3, tmp_path):
    """A worker registered a generator the learner cannot reach (as after a learner restart: no
    check at that registration), so the broadcaster drops it and, idle for data, publishes again
    every weights.timeout_s to take it back. Those publishes used to restart the wait for a batch
    each time: the learner waited for ever. Now the wait ends at buffer.batch_timeout_s, exit 2,
    with one line naming the cause."""
    import trio

    from asyncrl import wire
    from asyncrl.buffer.client import BufferClient
    from asyncrl.learner_info import read_learner_info
    from tests.ports import refused_url

    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    recipe = tmp_path / "rl.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "rl", "output_dir": str(tmp_path / "runs"), "steps": 3},
                "model": {"path": str(tiny_qwen3), "max_seq_len": 64},
                "data": {"path": str(prompts)},
                "buffer": {"groups_per_batch": 2, "batch_timeout_s": 10},
                "weights": {"timeout_s": 1, "backend": "gloo"},
                "learner": {"checkpoint_every": 0},
                "logging": {"wandb": False, "progress": False},
            }
        )
    )
    with refused_url() as down:  # held, not listening, until the learner has exited
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "asyncrl.cli", "learner", str(recipe)]
        with open(tmp_path / "err", "wb") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 180
            while (info := read_learner_info(tmp_path / "runs" / "rl")) is None:
                assert proc.poll() is None, (tmp_path / "err").read_text()[-2000:]
                assert time.monotonic() < deadline, "the learner did not listen within 180 s"
                time.sleep(0.1)

            async def register() -> None:
                async with BufferClient(info.buffer_address, worker_id="w0") as c:
                    await c.register([wire.GeneratorInfo(url=down, kind="builtin")])

            trio.run(register)
            code = proc.wait(timeout=120)  # it used to wait for ever
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (tmp_path / "err").read_text()
    assert code == 2 and "Traceback" not in text, text[-3000:]
    said = [line for line in text.splitlines() if line.startswith("asyncrl learner: ")]
    assert said[-1].startswith("asyncrl learner: no batch within 10 s (buffer.batch_timeout_s)")
    assert f"no weights to {down} (preflight: " in said[-1]
