"""The weight broadcaster end to end: the real learner (Trainer) as rank 0, real built-in engines as
generators, a real gloo group on loopback, real HTTP. After every update both engines hold exactly the
learner's weights (checksums), report the version, and decode greedily as a fresh load of the export;
requests in flight during the updates finish without abort. A killed engine is dropped within the
timeout while the other is updated, and catches up when it is back."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import numpy as np
import pytest
import torch

from asyncrl import recipe as recipe_mod
from asyncrl import wire
from asyncrl.buffer.store import Batch
from asyncrl.engine import start_engine_process
from asyncrl.metrics import MetricsSink, read_metrics
from asyncrl.recipe import WeightsConfig
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.buckets import checksum
from asyncrl.weights.snapshot import drop_tied

pytestmark = pytest.mark.slow

PROMPTS = [[10, 20, 30, 40], [50, 7, 9]]


def make_trainer(model_dir, tmp_path):
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    data = {
        "model": {"path": str(model_dir), "max_seq_len": 128},
        "run": {"output_dir": str(tmp_path), "name": "w"},
        "algorithm": {"loss": "sft"},
        "learner": {"lr": 3e-2},
    }
    return Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(data)), checkpointing=False)


def sft_batch(version: int, vocab: int, seed: int) -> Batch:
    """A tiny SFT batch: random completions the learner is pushed towards (its weights move a lot)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(2):
        c = rng.integers(3, vocab, size=16).astype(np.int32)
        samples.append(
            wire.Sample(
                id=f"s{seed}-{i}",
                group_id=f"g{seed}",
                prompt_ids=rng.integers(3, vocab, size=4).astype(np.int32),
                completion_ids=c,
                behavior_logprobs=np.zeros(len(c), np.float32),
                versions=np.full(len(c), version, np.int32),
                loss_mask=np.ones(len(c), np.float32),
                reward=1.0,
            )
        )
    return Batch(groups=[wire.Group(id=f"g{seed}", samples=samples)], version=version, stats={})


def step_and_publish(tr, b, batch: Batch) -> None:
    """A step, then its version to the broadcaster, as the learner's loop does
    (asyncrl/learner/main.py)."""
    tr.step(batch)
    b.on_step(tr.version, tr)


def greedy(url: str, prompt: list[int], n: int = 12) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


def hf_greedy(model_dir, prompt: list[int], n: int = 12) -> list[int]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = m.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            min_new_tokens=n,
        )
    return out[0, len(prompt) :].tolist()


def engine_checksum(url: str) -> str:
    r = httpx.post(url + "/weights_checker", json={"action": "checksum"}, timeout=60)
    return r.json()["checksum"]


class Stream:
    """A long streaming generation read in a thread, so it is in flight while weights change."""

    def __init__(self, url: str, n: int = 60):
        self.first = threading.Event()
        self.final: dict | None = None
        body = {
            "input_ids": PROMPTS[0],
            "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
        }
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url, body):
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    self.final = json.loads(line[5:])
                    self.first.set()

    @classmethod
    def frozen(cls, url: str) -> Stream:
        """A long request paused in place while it decodes (retried if it finished first)."""
        for _ in range(5):
            s = cls(url, n=400)
            assert s.first.wait(60)
            httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
            if httpx.get(url + "/engine_stats", timeout=30).json()["running"] == 1:
                return s
            httpx.post(url + "/continue_generation", json={}, timeout=30)
            s.result()
        pytest.fail("the request finished before it could be paused, 5 times")

    def result(self) -> dict:
        self.thread.join(120)
        assert not self.thread.is_alive() and self.final is not None
        return self.final


def start_engines(model_dir, n: int) -> list:
    """Start ``n`` engines at once (each loads its model in its own process)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(
            pool.map(
                lambda _: start_engine_process(model_dir, weight_version="0", timeout_s=120),
                range(n),
            )
        )


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    eps = start_engines(tiny_qwen3, 2)
    yield eps
    for ep in eps:
        ep.stop()


def test_learner_to_two_engines(engines, tiny_qwen3, tmp_path):
    tr = make_trainer(tiny_qwen3, tmp_path)
    vocab = tr.models.spec.model.vocab_size
    cfg = WeightsConfig(
        timeout_s=30.0, bucket_mb=0.1, overlap=True, load_format="flattened_bucket", verify="full"
    )
    sink = MetricsSink(tmp_path / "metrics", name="w", group="w", use_wandb=False)
    b = WeightBroadcaster(cfg, export_dir=tr.run_dir / "hf")
    e1, e2 = engines
    # e1 as the built-in engine (staged swap, no pause); e2 driven with SGLang's pause protocol
    b.add_generator(wire.GeneratorInfo(url=e1.url, kind="builtin"))
    b.add_generator(wire.GeneratorInfo(url=e2.url, kind="sglang"))
    before = greedy(e1.url, PROMPTS[1])
    # a request in flight on each engine, held in place so it is certainly live during the update
    streams = [Stream.frozen(e.url) for e in engines]
    try:
        for v in (1, 2):
            step_and_publish(tr, b, sft_batch(v - 1, vocab, seed=v))
            assert tr.version == v
            assert b.wait(timeout=120)
            sink.log(b.take_metrics(), step=v)
            r = b.reports[-1]
            assert r.version == v and not r.error, r
            assert sorted(r.updated) == sorted([e1.url, e2.url]) and not r.dropped
            assert r.reported == {e1.url: str(v), e2.url: str(v)}
            assert r.checksum_ok == {e1.url: True, e2.url: True}
            want = checksum(drop_tied(tr.hf_state_dict()).items())
            assert r.checksum == want
            assert engine_checksum(e1.url) == engine_checksum(e2.url) == want
            if v == 1:  # the first update uses several buckets and builds a group per engine
                assert r.group_builds == 2 and r.nbytes > cfg.bucket_mb * 2**20
            else:
                assert r.group_builds == 0
        assert set(b.reports[-1].pause_s) == {e1.url, e2.url}
    finally:
        for e in engines:
            httpx.post(e.url + "/continue_generation", json={}, timeout=30)
    for s in streams:  # in flight across the updates: finished normally, spans from v0 to a new one
        meta = s.result()["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        spans = meta["weight_versions"]
        assert spans[0]["version"] == "0" and spans[-1]["version"] in ("1", "2")
        assert spans[0]["start"] == 0 and spans[-1]["end"] == meta["completion_tokens"] == 400
    # greedy decoding equals a fresh load of the exported checkpoint
    export = tr.export_hf(tmp_path / "export")
    for p in PROMPTS:
        want = hf_greedy(export, p)
        assert greedy(e1.url, p) == greedy(e2.url, p) == want
    assert greedy(e1.url, PROMPTS[1]) != before  # the weights really moved
    b.close()
    tr.close()
    sink.close()
    recs = [r for r in read_metrics(tmp_path / "metrics") if "weights/sync_s" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["weights/sync_s"] > 0 and r["weights/bytes"] == b.reports[0].nbytes
        assert r["weights/dropped"] == r["weights/checksum_mismatch"] == 0
        assert r["weights/version_lag/max"] == 0 and r["weights/generators"] == 2
    hosts = {u.split("://")[1] for u in (e1.url, e2.url)}
    assert {k.rsplit("/", 1)[1] for k in recs[-1] if k.startswith("weights/pause_s/")} >= hosts


@pytest.mark.faults
def test_killed_engine_is_dropped_and_catches_up(tiny_qwen3, tmp_path):
    """SIGKILL one engine in the middle of an update (after the first of several buckets); later
    SIGSTOP the other between updates. Each is dropped within the timeouts and rejoins when back."""
    tr = make_trainer(tiny_qwen3, tmp_path)
    vocab = tr.models.spec.model.vocab_size
    cfg = WeightsConfig(timeout_s=8.0, bucket_mb=0.1, overlap=True)
    eps = start_engines(tiny_qwen3, 2)
    victim, other = eps
    killed = threading.Event()
    rejoined: list[str | None] = []

    def on_event(name, f):
        if name == "rejoining":
            rejoined.append(f["export"])
        if name == "bucket_sent" and f["version"] == 2 and f["index"] == 0 and not killed.is_set():
            os.kill(victim.pid, signal.SIGKILL)
            killed.set()

    b = WeightBroadcaster(cfg, export_dir=tr.run_dir / "hf", on_event=on_event)
    try:
        for ep in eps:
            b.add_generator(wire.GeneratorInfo(url=ep.url, kind="builtin"))
        step_and_publish(tr, b, sft_batch(0, vocab, seed=1))
        assert b.wait(timeout=60)
        assert b.reports[-1].updated == [victim.url, other.url], b.reports[-1]
        step_and_publish(
            tr, b, sft_batch(1, vocab, seed=2)
        )  # version 2: the victim dies after bucket 1
        assert b.wait(timeout=8 * cfg.timeout_s + 30)  # bounded by the timeouts, never a hang
        r = b.reports[-1]
        assert killed.is_set() and r.version == 2 and not r.error, r
        assert r.dropped == [victim.url] and r.updated == [other.url]
        assert r.reported == {other.url: "2"} and r.checksum_ok == {other.url: True}
        # the other was never in the failed collective: same attempt, its group kept (in a shared
        # group it timed out too, and SGLang aborts a server whose weight group fails)
        assert r.attempts == 1 and r.group_builds == 0, r
        assert b.generators() == {victim.url: "dropped", other.url: "member"}
        # the victim comes back on the same port; the learner exports v2; at v3 it rejoins
        tr.export_hf(tr.run_dir / "hf" / "v2")
        victim.proc.wait(10)
        back = start_engine_process(tiny_qwen3, port=victim.port, weight_version="0", timeout_s=120)
        eps.append(back)
        step_and_publish(tr, b, sft_batch(2, vocab, seed=3))
        assert b.wait(timeout=60)
        r = b.reports[-1]
        assert not r.error and sorted(r.updated) == sorted([victim.url, other.url]), r
        assert r.reported == {victim.url: "3", other.url: "3"}
        assert r.group_builds == 1  # the victim's new group; the other's stays
        assert rejoined == [str(tr.run_dir / "hf" / "v2")]  # it loaded the export before joining
        assert r.checksum_ok == {victim.url: True, other.url: True}
        assert engine_checksum(back.url) == checksum(drop_tied(tr.hf_state_dict()).items())
        # a hung (not dead) engine: SIGSTOP. Its calls time out, it is dropped, the other goes on
        os.kill(other.pid, signal.SIGSTOP)
        try:
            step_and_publish(tr, b, sft_batch(3, vocab, seed=4))
            assert b.wait(timeout=8 * cfg.timeout_s + 30)
            r = b.reports[-1]
            assert not r.error and r.dropped == [other.url] and r.updated == [back.url], r
        finally:
            os.kill(other.pid, signal.SIGCONT)
        step_and_publish(
            tr, b, sft_batch(4, vocab, seed=5)
        )  # it answers again: it rejoins at version 5
        assert b.wait(timeout=60)
        r = b.reports[-1]
        assert sorted(r.updated) == sorted([back.url, other.url]), r
        assert r.reported == {back.url: "5", other.url: "5"}
        assert r.checksum_ok == {back.url: True, other.url: True}
    finally:
        b.close()
        tr.close()
        for ep in eps:
            ep.stop()


@pytest.mark.faults
def test_an_engine_silent_mid_broadcast_costs_the_other_nothing(tiny_qwen3, tmp_path):
    """SIGSTOP one engine after the first of several buckets: the other still receives every
    bucket of that version in the same attempt, over its own group (never rebuilt), and holds
    exactly the learner's weights; the silent one is dropped after ``timeout_s``."""
    tr = make_trainer(tiny_qwen3, tmp_path)
    vocab = tr.models.spec.model.vocab_size
    cfg = WeightsConfig(timeout_s=4.0, bucket_mb=0.1, overlap=True)
    eps = start_engines(tiny_qwen3, 2)
    victim, other = eps
    stopped = threading.Event()
    built: list[tuple[int, str]] = []  # (version being sent, url) of each group build

    def on_event(name, f):
        if name == "group_built":
            built.append((tr.version, f["url"]))
        if name == "bucket_sent" and f["version"] == 2 and f["index"] == 0 and not stopped.is_set():
            os.kill(victim.pid, signal.SIGSTOP)
            stopped.set()

    b = WeightBroadcaster(cfg, on_event=on_event)
    try:
        for ep in eps:
            b.add_generator(wire.GeneratorInfo(url=ep.url, kind="builtin"))
        step_and_publish(tr, b, sft_batch(0, vocab, seed=1))
        assert b.wait(timeout=60)
        assert sorted(b.reports[-1].updated) == sorted([victim.url, other.url]), b.reports[-1]
        step_and_publish(
            tr, b, sft_batch(1, vocab, seed=2)
        )  # version 2: the victim stops after bucket 1
        assert b.wait(timeout=8 * cfg.timeout_s + 30)
        r = b.reports[-1]
        assert stopped.is_set() and r.version == 2 and not r.error, r
        assert r.dropped == [victim.url] and r.updated == [other.url], r
        assert r.attempts == 1 and r.group_builds == 0, r
        assert r.reported == {other.url: "2"} and r.checksum_ok == {other.url: True}
        assert engine_checksum(other.url) == checksum(drop_tied(tr.hf_state_dict()).items())
        assert sorted(built) == sorted([(1, victim.url), (1, other.url)])
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        b.close()
        tr.close()
        for ep in eps:
            ep.stop()


def test_two_rank_learner_under_torchrun(engines, tiny_qwen3, tmp_path):
    """FSDP over 2 ranks: every rank takes the hf_state_dict() collective, rank 0 alone sends."""
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("ranks_worker.py")
    urls = ",".join(e.url for e in engines)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(worker), str(tiny_qwen3), str(tmp_path), urls]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["world"] == 2 and [r["version"] for r in res["reports"]] == [1, 2]
    for r in res["reports"]:
        assert not r["error"] and sorted(r["updated"]) == sorted(e.url for e in engines)
        assert set(r["checksum_ok"].values()) == {True}
        assert set(r["reported"].values()) == {str(r["version"])}
    for e in engines:
        assert engine_checksum(e.url) == res["checksum"]
    for p_ in PROMPTS:
        assert (
            greedy(engines[0].url, p_)
            == greedy(engines[1].url, p_)
            == hf_greedy(tmp_path / "export", p_)
        )


def test_weight_group_layout_follows_each_servers_tensor_parallel_size():
    """SGLang gives TP worker r of a server the rank rank_offset + r: a TP-2 and a TP-4 server after
    the learner take ranks 1-2 and 3-6. Layouts SGLang cannot join are refused with the fix."""
    from asyncrl.weights.rendezvous import LayoutError, group_layout, server_ranks

    assert server_ranks({"tp_size": 2, "dp_size": 1, "pp_size": 1}) == 2
    assert server_ranks({"tp_size": 4}) == 4
    assert group_layout([2, 4]) == ([1, 3], 7)
    assert group_layout([1, 1, 1]) == ([1, 2, 3], 4)
    with pytest.raises(LayoutError, match="dp_size 2: .* one server per data-parallel replica"):
        server_ranks({"tp_size": 2, "dp_size": 2})
    with pytest.raises(LayoutError, match="pp_size 2"):
        server_ranks({"tp_size": 1, "pp_size": 2})


def engine_version(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=30).json()["weight_version"]


def test_generators_hold_a_version_while_after_sync_runs(tiny_qwen3, tmp_path):
    """The held-out evaluation's guarantee (asyncrl.learner.eval_schedule): while ``after_sync(v)``
    runs the generators hold v, and the learner goes on: the versions it publishes meanwhile do
    not wait; the newest goes out when the hook returns (the one before it is skipped)."""
    tr = make_trainer(tiny_qwen3, tmp_path)
    vocab = tr.models.spec.model.vocab_size
    in_hook, release = threading.Event(), threading.Event()

    def hold(report) -> None:
        if report.version == 1:
            in_hook.set()
            release.wait(120)

    with start_engine_process(tiny_qwen3, weight_version="0", timeout_s=120) as ep:
        b = WeightBroadcaster(WeightsConfig(timeout_s=30.0), after_sync=hold)
        b.add_generator(wire.GeneratorInfo(url=ep.url, kind="builtin"))
        step_and_publish(tr, b, sft_batch(0, vocab, seed=1))
        assert in_hook.wait(120)
        step_and_publish(
            tr, b, sft_batch(1, vocab, seed=2)
        )  # returns: publish does not wait for the hook
        step_and_publish(tr, b, sft_batch(2, vocab, seed=3))
        assert tr.version == 3 and not b.wait(timeout=0)
        assert engine_version(ep.url) == "1"
        release.set()
        assert b.wait(timeout=120)
        assert [r.version for r in b.reports] == [1, 3] and b.sender.skipped == 1
        assert not b.reports[-1].error and engine_version(ep.url) == "3"
        assert engine_checksum(ep.url) == checksum(drop_tied(tr.hf_state_dict()).items())
        b.close()
    tr.close()
