"""`asyncrl rollout` as a real process: its own built-in engine, a real buffer on loopback nng."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import yaml

from asyncrl.rollout import main as rollout_main
from tests.rollout.test_worker import serve_buffer, take_batch


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


async def _deliver(svc, recipe: Path, *args: str, version: int = 0, timeout_s: float = 120):
    """Run `asyncrl rollout` (worker0) against ``svc`` (at ``version``) until it exits; (the
    process, the next batch the learner would get)."""
    if version:
        await trio.to_thread.run_sync(svc.set_version, version)
    argv = [sys.executable, "-m", "asyncrl.cli", "rollout", str(recipe), *args]
    argv += ["--buffer", svc.address, "--pub", svc.pub_address, "--worker-id", "worker0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    with trio.fail_after(timeout_s):
        proc = await trio.run_process(argv, capture_stderr=True, check=False, env=env)
    return proc, await take_batch(svc)


def test_rollout_process_delivers_groups_with_its_own_engine(tmp_path, tiny_qwen3):
    recipe = _recipe(tmp_path, tiny_qwen3)
    with serve_buffer(groups_per_batch=3, max_staleness=0) as svc:
        proc, stored = trio.run(
            _deliver, svc, recipe, "--max-groups", "3", "rollout.temperature=0.5"
        )
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


def test_learner_file_gives_the_addresses_of_a_listening_learner(tmp_path, tiny_qwen3):
    """--learner-file: a finished run's learner.json is waited past; the one a listening learner
    writes gives the worker its addresses (what the sbatch launcher relies on)."""
    from asyncrl.learner_info import LearnerInfo

    recipe = _recipe(tmp_path, tiny_qwen3)
    learner_file = tmp_path / "runs/t/learner.json"

    def info(svc, ended_at):
        return LearnerInfo(
            buffer_address=svc.address,
            pub_address=svc.pub_address,
            weights_master="127.0.0.1:0",
            rollout_command="asyncrl rollout ...",
            host="here",
            pid=os.getpid(),
            version=0,
            started_at=0.0,
            ended_at=ended_at,
        )

    async def go(svc, old):
        info(old, ended_at=1.0).write(learner_file.parent)  # the last run's, ended
        argv = [sys.executable, "-m", "asyncrl.cli", "rollout", str(recipe), "--max-groups", "2"]
        argv += ["--learner-file", str(learner_file), "--worker-id", "worker0"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        async with trio.open_nursery() as n:
            run = functools.partial(trio.run_process, argv, stderr=err, check=False, env=env)
            proc = await n.start(run)
            with trio.fail_after(60):  # it waits past the ended file...
                while "waiting for a learner" not in (tmp_path / "err").read_text():
                    await trio.sleep(0.1)
            info(svc, ended_at=None).write(learner_file.parent)  # ...until a listening learner
            with trio.fail_after(120):
                await proc.wait()
        return proc, await take_batch(svc)

    with (
        serve_buffer(groups_per_batch=2, max_staleness=0) as svc,
        serve_buffer(groups_per_batch=2, max_staleness=0) as old,
        open(tmp_path / "err", "wb") as err,
    ):
        proc, stored = trio.run(go, svc, old)
        assert old.stats()["stored_total"] == 0
    text = (tmp_path / "err").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert len(stored) == 2 and "joining the learner on here" in text


def test_user_mistakes_are_one_line_errors(tmp_path, tiny_qwen3, capsys):
    assert rollout_main.main([str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err
    recipe = _recipe(tmp_path, tiny_qwen3)
    assert rollout_main.main([str(recipe), "rollout.reward=no_such_reward"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("asyncrl rollout: rollout.reward: 'no_such_reward' is not one of")
    assert rollout_main.main([str(recipe), "--shard", "3/2"]) == 2
    assert "--shard '3/2'" in capsys.readouterr().err
    argv = [str(recipe), "--learner-file", str(tmp_path / "learner.json"), "--buffer", "ipc:///x"]
    assert rollout_main.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "asyncrl rollout: --learner-file gives the addresses: drop --buffer and --pub"


def test_a_worker_started_alone_takes_urls_not_a_reward_model_path(
    tmp_path, tiny_qwen3, tiny_reward_model, capsys
):
    """rollout.reward_model.path is for `asyncrl run`, which serves it and passes the urls; a worker
    started alone with only the path says so in one line, before starting an engine."""
    recipe = _recipe(tmp_path, tiny_qwen3)
    argv = [str(recipe), "rollout.reward=model", f"rollout.reward_model.path={tiny_reward_model}"]
    assert rollout_main.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("asyncrl rollout: rollout.reward_model.urls: `asyncrl run` starts")
    assert "Traceback" not in "\n".join(err)


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


def _export(src: Path, dest: Path, seed: int) -> Path:
    """An HF export of other weights than ``src``'s (every tensor moved by seeded noise)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    g = torch.Generator().manual_seed(seed)
    for f in dest.glob("*.safetensors"):
        w = load_file(str(f))
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w.items()}, str(f))
    return dest


def test_a_worker_joining_a_run_starts_its_engine_from_the_learners_newest_export(
    tmp_path, tiny_qwen3
):
    """The run folder holds exports v3 and v5 and the learner has announced 4 (v5 is a lost run's,
    left by a learner resumed from an older checkpoint): the worker's engine starts from v3, says
    so, and the delivered tokens are v3's, as its weights' logprobs show (not only the label)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.numerics import LOGPROB_ATOL

    recipe = _recipe(tmp_path, tiny_qwen3, temperature=1.0)
    hf = tmp_path / "runs/t/hf"
    v3 = _export(tiny_qwen3, hf / "v3", seed=3)
    _export(tiny_qwen3, hf / "v5", seed=5)

    args = ("buffer.max_staleness=1", "--max-groups", "2")
    with serve_buffer(groups_per_batch=2, max_staleness=1) as svc:
        proc, stored = trio.run(
            functools.partial(_deliver, svc, recipe, *args, version=4, timeout_s=180)
        )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert f"starting the engines from {v3} (version 3)" in err
    model = AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval()
    for g in stored:
        for s in g.samples:
            assert (s.versions == 3).all()
            ids = torch.tensor([s.prompt_ids.tolist() + s.completion_ids.tolist()])
            with torch.no_grad():
                logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].double()
            lp = torch.log_softmax(logits, -1)[
                torch.arange(len(s.completion_ids)), s.completion_ids.tolist()
            ]
            err_v3 = float((lp - torch.tensor(s.behavior_logprobs.tolist())).abs().max())
            assert err_v3 <= LOGPROB_ATOL, err_v3


@pytest.mark.parametrize("advantage, greedy", [("grpo", False), ("remax", True)])
def test_the_worker_takes_its_settings_from_the_recipe(advantage: str, greedy: bool) -> None:
    from asyncrl import recipe
    from asyncrl.rollout.worker_config import WorkerConfig

    root = Path(__file__).resolve().parents[2]
    r = recipe.load(
        root / "recipes/demo.yaml",
        [
            f"algorithm.advantage={advantage}",
            "rollout.group_size=5",
            "buffer.max_staleness=3",
            "model.max_seq_len=100",
            "rollout.max_new_tokens=30",
        ],
        check_files=False,
    )
    cfg = WorkerConfig.from_recipe(r, "w7", max_groups=9)
    assert (cfg.worker_id, cfg.group_size, cfg.max_staleness, cfg.max_groups) == ("w7", 5, 3, 9)
    assert cfg.max_prompt_tokens == 70  # what the context leaves after the completion's budget
    assert cfg.greedy_baseline is greedy  # ReMax's baseline episode


def _own_network() -> list[str]:
    """A command prefix running a process on a network of its own (a new network namespace with
    only loopback, up): another host as far as addresses go, the same one for files (ipc://).
    Skips, saying why, where namespaces cannot be made."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):  # root, else a user namespace
        try:
            probe = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True)
        except FileNotFoundError as e:
            pytest.skip(f"no network namespaces here: {e.filename} is missing")
        if probe.returncode == 0:
            return [*prefix, "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    pytest.skip(f"no network namespaces here: {probe.stderr.decode().strip()}")


def test_a_worker_whose_engine_the_learner_cannot_reach_stops_with_one_line(tmp_path, tiny_qwen3):
    """The worker on a network of its own (another host), the learner's buffer reached over ipc://:
    its engine on loopback serves the worker but not the learner. The learner refuses the first
    registration, and the worker exits 2 at once with that one line (not a silent drop, then a
    wait that never ends)."""
    from asyncrl.buffer.service import BufferService
    from asyncrl.reach import unreachable
    from asyncrl.recipe import BufferConfig

    prefix = _own_network()
    recipe = _recipe(tmp_path, tiny_qwen3)
    sock = tmp_path / "sock"
    sock.mkdir()
    cfg = BufferConfig(address=f"ipc://{sock}/b.ipc", pub_address=f"ipc://{sock}/p.ipc")
    argv = [*prefix, sys.executable, "-m", "asyncrl.cli", "rollout", str(recipe)]
    argv += ["--buffer", cfg.address, "--pub", cfg.pub_address, "--worker-id", "worker0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    with BufferService(cfg, announce_every_s=0.2, reach=unreachable) as svc:
        proc = subprocess.run(argv, env=env, capture_output=True, timeout=120)
        assert svc.stats()["workers_registered"] == 0
    err = proc.stderr.decode()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    said = err.strip().splitlines()[-1]  # the last line, after the progress bar's
    assert said.startswith("asyncrl rollout: the learner cannot reach generator http://127.0.0.1:")
    assert "(ConnectError:" in said and "generator.host" in said


def test_a_lora_workers_engines_start_from_the_base_and_the_adapter_export(tmp_path, tiny_qwen3):
    """With learner.lora on, the newest export is a PEFT adapter folder: the worker's engines load
    model.path as the base, serve the adapter over it under the export's version, and take the
    next versions' adapters (they are started with the recipe's rank and alpha)."""
    import httpx

    from asyncrl import recipe as recipe_mod
    from asyncrl.weights.exports import VERSION_FILE
    from tests.engine.test_lora_serving import ALPHA, RANK, assert_serves, peft_model

    r = recipe_mod.from_dict(
        {
            "run": {"name": "t", "output_dir": str(tmp_path / "runs")},
            "model": {"path": str(tiny_qwen3)},
            "learner": {"lora": {"rank": RANK, "alpha": ALPHA}},
            "generator": {"kind": "builtin", "engines_per_worker": 1},
        }
    )
    pm, _ = peft_model(tiny_qwen3, seed=7)
    export = r.run_dir / "hf" / "v2"
    pm.save_pretrained(export)
    (export / VERSION_FILE).write_text(json.dumps({"version": 2}))
    weights = rollout_main.engine_weights(r, learner_version=2)
    assert weights == (export, 2)
    (engine,) = rollout_main.spawn_engines(r, tmp_path, "w0", weights)
    try:
        rollout_main.wait_engines([engine], 120)
        info = httpx.get(engine.url + "/server_info", timeout=30).json()
        assert info["model_path"] == str(tiny_qwen3) and info["max_lora_rank"] == RANK
        assert httpx.get(engine.url + "/model_info", timeout=30).json()["weight_version"] == "2"
        assert_serves(engine.url, pm)
    finally:
        engine.stop()
