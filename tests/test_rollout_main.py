"""`asyncrl rollout` as a real process: its own built-in engine, a real buffer on loopback nng."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio
import yaml
from test_rollout_worker import serve_buffer, take_batch

from asyncrl.rollout import main as rollout_main


def _recipe(tmp_path, model, **rollout):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8))
        + "{broken\n"
    )
    r = {
        "run": {"name": "t", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model), "max_seq_len": 256},
        "data": {"path": str(data)},
        "rollout": {"group_size": 2, "max_concurrent_groups": 2, "max_new_tokens": 8, **rollout},
        "generator": {"kind": "builtin", "engines_per_worker": 1},
        "buffer": {"groups_per_batch": 4, "max_staleness": 0},
        "logging": {"wandb": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def test_rollout_process_delivers_groups_with_its_own_engine(tmp_path, tiny_qwen3):
    recipe = _recipe(tmp_path, tiny_qwen3)

    async def go(svc):
        argv = [sys.executable, "-m", "asyncrl.cli", "rollout", str(recipe)]
        argv += ["--buffer", svc.address, "--pub", svc.pub_address, "--worker-id", "worker0"]
        argv += ["--max-groups", "3", "rollout.temperature=0.5"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        with trio.fail_after(120):
            proc = await trio.run_process(argv, capture_stderr=True, check=False, env=env)
        return proc, await take_batch(svc)

    with serve_buffer(groups_per_batch=3, max_staleness=0) as svc:
        proc, stored = trio.run(go, svc)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert len(stored) == 3
    for g in stored:
        assert len(g.samples) == 2 and g.metadata["worker_id"] == "worker0"
    assert f"{tmp_path / 'train.jsonl'}:9: not valid JSON" in err  # the malformed row, reported
    records = [json.loads(x) for x in (tmp_path / "runs/t/metrics.jsonl").read_text().splitlines()]
    assert all(r["process"] == "worker0" for r in records)
    last = [r for r in records if "rollout/groups_delivered" in r][-1]
    assert last["rollout/groups_delivered"] >= 3
    assert max(r.get("rollout/tokens_per_s", 0) for r in records) > 0
    assert any("rollout/reward_hist" in r for r in records)
    assert 0 <= last["rollout/generator_idle_fraction"] <= 1


def test_user_mistakes_are_one_line_errors(tmp_path, tiny_qwen3, capsys):
    assert rollout_main.main([str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err
    recipe = _recipe(tmp_path, tiny_qwen3)
    assert rollout_main.main([str(recipe), "rollout.reward=no_such_reward"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("asyncrl rollout: rollout.reward: 'no_such_reward' is not one of")
    assert rollout_main.main([str(recipe), "--shard", "3/2"]) == 2
    assert "--shard '3/2'" in capsys.readouterr().err


@pytest.mark.faults
def test_worker_exits_when_its_engine_dies(tmp_path, tiny_qwen3):
    """Kill the worker's built-in engine (SIGKILL): the worker ends with exit code 1 and says why,
    so the launcher can restart it, instead of waiting on a generator that will not come back."""
    recipe = _recipe(tmp_path, tiny_qwen3, max_new_tokens=64)

    async def go(svc):
        argv = [sys.executable, "-m", "asyncrl.cli", "rollout", str(recipe)]
        argv += ["--buffer", svc.address, "--pub", svc.pub_address, "--worker-id", "worker0"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        async with trio.open_nursery() as n:
            run = functools.partial(trio.run_process, argv, stderr=err, check=False, env=env)
            proc = await n.start(run)
            with trio.fail_after(120):  # until the worker delivered a group: its engine is up
                while svc.stats()["stored_total"] < 1:
                    await trio.sleep(0.1)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert len(children) == 1  # the engine
            os.kill(int(children[0]), signal.SIGKILL)
            with trio.fail_after(60):
                await proc.wait()
        return proc

    with (
        serve_buffer(groups_per_batch=64, max_staleness=0) as svc,
        open(tmp_path / "err", "wb") as err,
    ):
        proc = trio.run(go, svc)
    assert proc.returncode == 1
    assert "asyncrl rollout: built-in engine http://127.0.0.1:" in (tmp_path / "err").read_text()
