"""A reward model as a reward: the built-in engine serves a sequence-classification folder over
SGLang's /classify, and the rollout's model reward scores completions there in batches, combined
with the rule reward, normalised, and cut at its timeout by a server that hangs (a real HTTP server
on loopback each time)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
import trio

from asyncrl import recipe as recipe_mod
from asyncrl.served.model_reward import CombinedReward, ScoreNorm, build_reward, parse_scores


@pytest.fixture(scope="module")
def rm_server(tiny_reward_model):
    from asyncrl.engine.api import EngineConfig
    from asyncrl.engine.server import serve

    srv = serve(EngineConfig(model=str(tiny_reward_model)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_scores(tiny_reward_model):
    """transformers' model of the folder, one unpadded sequence at a time, its head at the last
    token (SGLang's Pooler(LAST)). Not the model's own ``logits``: transformers pools at the last
    token that is not ``pad_token_id``, so a sampled completion that ends in the pad token (the tiny
    models' vocabulary has it, and sampling can draw it) would be scored one token early."""
    from transformers import AutoModelForSequenceClassification

    m = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model, dtype=torch.float32)

    def score(ids: list[int]) -> float:
        with torch.no_grad():
            h = m.model(input_ids=torch.tensor([ids])).last_hidden_state
            return float(m.score(h[0, -1]).float()[0])

    return score


@pytest.fixture(scope="module")
def tok(tiny_reward_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_reward_model)


def test_classify_answers_in_sglang_shape_with_the_models_scores(rm_server, hf_scores, tok):
    pad = tok.pad_token_id  # a completion may end in it: scored at it, as SGLang does
    seqs = [
        tok("dcab=")["input_ids"] + tok("abcd")["input_ids"],
        tok("x")["input_ids"],
        tok("ab=")["input_ids"] + [pad],
    ]
    r = httpx.post(f"{rm_server.url}/classify", json={"input_ids": seqs})
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and len(body) == 3
    for item, ids in zip(body, seqs, strict=True):
        assert set(item) == {"embedding", "meta_info"}
        assert item["meta_info"]["prompt_tokens"] == len(ids)
        assert item["embedding"][0] == pytest.approx(hf_scores(ids), abs=1e-5)
    one = httpx.post(f"{rm_server.url}/classify", json={"text": "dcab=abcd"}).json()
    assert isinstance(one, dict)
    assert one["embedding"][0] == pytest.approx(hf_scores(tok("dcab=abcd")["input_ids"]), abs=1e-5)
    named = httpx.post(f"{rm_server.url}/classify", json={"text": ["a", "b"], "rid": "r"}).json()
    assert [x["meta_info"]["id"] for x in named] == ["r_0", "r_1"]
    bad = httpx.post(f"{rm_server.url}/classify", json={"input_ids": [[1, 10**9]]})
    assert bad.status_code == 400 and "input_ids[0]" in bad.json()["error"]["message"]
    assert httpx.get(f"{rm_server.url}/model_info").json()["is_generation"] is False


def _recipe(**reward_model) -> recipe_mod.Recipe:
    rm = {"timeout_s": 5.0, "batch_size": 4} | reward_model
    return recipe_mod.from_dict({"rollout": {"reward": "model", "reward_model": rm}})


def _score_all(reward, samples: list[tuple[list[int], list[int], dict]], tok) -> list:
    """Every sample scored concurrently, as a group's episodes finish together."""
    out: list = [None] * len(samples)

    async def one(i: int, p: list[int], c: list[int], row: dict) -> None:
        out[i] = await reward.score(
            prompt="p=",
            completion=None,
            prompt_ids=p,
            completion_ids=c,
            row=row,
            extra={"finish_reason": "stop"},
            decode=tok.decode,
        )

    async def main() -> None:
        async with trio.open_nursery() as n:
            for i, (p, c, row) in enumerate(samples):
                n.start_soon(one, i, p, c, row)

    trio.run(main)
    return out


def _samples(tok, n: int) -> list[tuple[list[int], list[int], dict]]:
    words = ["abcd", "dcba", "bd", "hello", "a", "zz", "sorted", "xyz", "qq", "ok"]
    return [
        (tok("p=")["input_ids"], tok(words[i % 10])["input_ids"], {"answer": "ok"})
        for i in range(n)
    ]


def test_rollout_rewards_are_the_models_scores_in_batches(rm_server, hf_scores, tok):
    reward = build_reward(_recipe(urls=[rm_server.url]))
    assert isinstance(reward, CombinedReward) and reward.rule is None
    samples = _samples(tok, 10)
    results = _score_all(reward, samples, tok)
    for r, (p, c, _) in zip(results, samples, strict=True):
        assert r.failure == ""
        assert r.value == pytest.approx(hf_scores(p + c), abs=1e-5)
    assert reward.model.stats["requests"] == 3  # 10 samples in batches of at most 4
    again = _score_all(reward, samples, tok)  # another event loop (as each held-out evaluation)
    assert [r.value for r in again] == pytest.approx([r.value for r in results], abs=1e-5)


def test_rule_and_model_rewards_add_with_their_weights(rm_server, hf_scores, tok):
    r = recipe_mod.from_dict(
        {
            "rollout": {
                "reward": "exact_match",
                "reward_weight": 0.5,
                "reward_model": {"urls": [rm_server.url], "weight": 2.0},
            }
        }
    )
    reward = build_reward(r)
    samples = _samples(tok, 10)
    results = _score_all(reward, samples, tok)
    for res, (p, c, _) in zip(results, samples, strict=True):
        rule = 1.0 if tok.decode(c) == "ok" else 0.0
        assert res.value == pytest.approx(0.5 * rule + 2.0 * hf_scores(p + c), abs=1e-4)


def test_normalisation_fixed_and_running(rm_server, hf_scores, tok):
    samples = _samples(tok, 4)
    raw = [hf_scores(p + c) for p, c, _ in samples]
    fixed = build_reward(_recipe(urls=[rm_server.url], normalize="fixed", shift=1.0, scale=2.0))
    for res, s in zip(_score_all(fixed, samples, tok), raw, strict=True):
        assert res.value == pytest.approx((s - 1.0) / 2.0, abs=1e-5)
    running = build_reward(_recipe(urls=[rm_server.url], normalize="running"))
    values = [r.value for r in _score_all(running, samples, tok)]  # one batch: its own mean and std
    mean, std = torch.tensor(raw).mean(), torch.tensor(raw).std()
    assert values == pytest.approx(((torch.tensor(raw) - mean) / std).tolist(), abs=1e-4)


def test_a_groups_samples_share_one_running_scale(rm_server, hf_scores, tok):
    """Issue #53 item 4.5: a running normalisation moves with every server batch, and one group's
    samples are scored in several (here 6 samples in batches of 2, all of group "g" but the first
    two of group "h"). Each group is normalised with one affine map, so its samples' normalised
    differences are their raw differences over one scale. The old code normalised each server
    batch with the statistics after it: the group's later batches had other scales."""
    from asyncrl.contract import Episode, EpisodeContext

    reward = build_reward(_recipe(urls=[rm_server.url], normalize="running", batch_size=2))
    samples = _samples(tok, 6)
    rids = ["h/0", "h/1", "g/0", "g/1", "g/2", "g/greedy"]  # the greedy episode is g's too
    out: dict[str, float] = {}

    async def one(rid: str, p: list[int], c: list[int]) -> None:
        ctx = EpisodeContext(prompt_ids=p, prompt_text="p=", row={"answer": "ok"}, pool=None,
                             params=None, tokenizer=tok, tools=None, max_turns=1, rid=rid)  # fmt: skip
        r = await reward.score_episode(ctx, Episode(completion_ids=c))
        assert r.failure == ""
        out[rid] = r.value

    async def main() -> None:
        for k in range(0, 6, 2):  # a server batch at a time, as a group's episodes finish apart
            async with trio.open_nursery() as n:
                for rid, (p, c, _) in zip(rids[k : k + 2], samples[k : k + 2], strict=True):
                    n.start_soon(one, rid, p, c)

    trio.run(main)
    raw = {rid: hf_scores(p + c) for rid, (p, c, _) in zip(rids, samples, strict=True)}
    g = [r for r in rids if r.startswith("g/")]
    scales = [(raw[a] - raw[b]) / (out[a] - out[b]) for a in g for b in g if a < b]
    assert max(scales) == pytest.approx(min(scales), rel=1e-4), scales
    # one map for the group: the statistics when its first score came back (its batch included)
    seen = torch.tensor([raw[r] for r in rids[:4]], dtype=torch.float64)
    for r in g:
        assert out[r] == pytest.approx(float((raw[r] - seen.mean()) / seen.std()), abs=1e-4)


def test_score_norm_running_is_welford():
    n = ScoreNorm("running")
    assert n(3.0) == 3.0  # nothing seen yet: unnormalised
    n.update([1.0, 2.0, 3.0, 4.0])
    assert (n.mean, n.std) == pytest.approx((2.5, 1.2909944))
    assert n(2.5) == 0.0


def test_parse_scores_refuses_what_is_not_a_score():
    assert parse_scores([{"embedding": [1.5]}, {"embedding": [-2]}], 2) == [1.5, -2.0]
    assert parse_scores({"embedding": [0.25], "meta_info": {}}, 1) == [0.25]
    with pytest.raises(ValueError, match="1 results for 2"):
        parse_scores([{"embedding": [1.0]}], 2)
    with pytest.raises(ValueError, match="no embedding"):
        parse_scores([{"error": "x"}], 1)


class _Hang(BaseHTTPRequestHandler):
    """Reads the request and never answers (until the test ends)."""

    release = threading.Event()

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.release.wait(30)


class _Fail(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(500)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"boom")


def _server(handler):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_hanging_server_is_cut_at_the_timeout_and_recorded(tok):
    httpd, url = _server(_Hang)
    try:
        r = recipe_mod.from_dict(
            {
                "rollout": {
                    "reward": "exact_match",
                    "reward_model": {"urls": [url], "timeout_s": 0.5},
                }
            }
        )
        reward = build_reward(r)
        t0 = time.monotonic()
        samples = [(tok("p=")["input_ids"], tok("ok")["input_ids"], {"answer": "ok"})] * 3
        results = _score_all(reward, samples, tok)
        assert time.monotonic() - t0 < 3.0
        for res in results:  # the model's part failed, so the sum did: the reason is recorded
            assert "model:" in res.failure and "timed out after 0.5s" in res.failure
        assert reward.model.stats["timeouts"] == 1 and reward.model.stats["failures"] == 3
    finally:
        _Hang.release.set()
        httpd.shutdown()


def test_failing_server_is_a_recorded_failure_or_passes_to_the_next(tok, rm_server, hf_scores):
    from tests.ports import refused_url

    httpd, url = _server(_Fail)
    sample = (tok("p=")["input_ids"], tok("ok")["input_ids"], {})
    try:
        reward = build_reward(_recipe(urls=[url]))
        (res,) = _score_all(reward, [sample], tok)
        assert res.value == 0.0 and "HTTP 500" in res.failure and "boom" in res.failure
        with refused_url() as nobody:  # held, not listening, while the reward calls it
            reward = build_reward(_recipe(urls=[url, nobody, rm_server.url]))
            results = _score_all(reward, [sample] * 6, tok)
        for res in results:  # each batch reaches the live server
            assert res.failure == ""
            assert res.value == pytest.approx(hf_scores(sample[0] + sample[1]), abs=1e-5)
    finally:
        httpd.shutdown()


def test_worker_groups_carry_the_models_scores_and_leave_its_failures_out(
    rollout_engine, tok, rm_server, hf_scores
):
    """A rollout worker (real engine, real buffer): every sample's reward is the reward model's score
    of its prompt + completion; with a server that hangs, no sample has a reward, so no group is sent
    (each dropped, the timeouts counted) and the worker stops after max_consecutive_failures."""
    from tests.labels import set_label
    from tests.rollout.test_worker import make_worker, run_to_failure, serve_buffer, take_batch

    async def run(svc, reward):
        async with make_worker(
            rollout_engine, tok, svc.address, reward_runner=reward, max_groups=2
        ) as w:
            await w.run()
        return await take_batch(svc)

    async def run_hanging(svc, reward):
        async with make_worker(
            rollout_engine, tok, svc.address, reward_runner=reward, max_consecutive_failures=2
        ) as w:
            error = await run_to_failure(w)
        assert "timed out after 1s" in str(error), error
        return w.stats.counters, svc.stats()

    httpd, hang_url = _server(_Hang)
    _Hang.release.clear()
    set_label(rollout_engine.url, "default")
    try:
        reward = build_reward(_recipe(urls=[rm_server.url], timeout_s=1.0))
        with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
            groups = trio.run(run, svc, reward)
        samples = [s for g in groups for s in g.samples]
        assert len(samples) == 6
        for s in samples:
            ids = [*s.prompt_ids.tolist(), *s.completion_ids.tolist()]
            assert s.reward == pytest.approx(hf_scores(ids), abs=1e-5)
            assert "reward_failure" not in s.metadata
        reward = build_reward(_recipe(urls=[hang_url], timeout_s=1.0))
        with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
            c, stats = trio.run(run_hanging, svc, reward)
        assert stats["stored_total"] == 0
        assert c["groups_dropped_reward_failures"] == 2 and c["reward_failures"] >= 6
    finally:
        _Hang.release.set()
        httpd.shutdown()
        set_label(rollout_engine.url, "default")


def test_a_path_without_urls_is_for_asyncrl_run_to_serve(tiny_reward_model):
    """rollout.reward_model.path is served by `asyncrl run`, which passes the servers' urls; a
    process started alone (`asyncrl rollout`) with only the path is told to give urls."""
    r = recipe_mod.from_dict(
        {"rollout": {"reward": "model", "reward_model": {"path": str(tiny_reward_model)}}}
    )
    with pytest.raises(recipe_mod.RecipeError) as e:
        build_reward(r)
    assert e.value.key == "rollout.reward_model.urls" and "asyncrl run" in str(e.value)


def test_held_out_evaluation_scores_the_ground_truth_with_eval_reward(rm_server):
    """A policy trained on the reward model alone is judged by rollout.eval_reward's rule against
    the data's answers, not by the model's score; unset, the evaluation scores as the rollouts do."""
    from asyncrl.rollout.held_out_eval import eval_reward

    def score(reward, completion: str) -> float:
        async def go():
            return await reward.score(
                prompt="dcab=",
                completion=completion,
                prompt_ids=[1, 2],
                completion_ids=[3, 4],
                row={"answer": "abcd"},
            )

        return trio.run(go).value

    rm = {"urls": [rm_server.url], "input": "text"}
    ground_truth = eval_reward(
        recipe_mod.from_dict(
            {"rollout": {"reward": "model", "reward_model": rm, "eval_reward": "exact_match"}}
        )
    )
    assert score(ground_truth, "abcd") == 1.0 and score(ground_truth, "dcab") == 0.0
    same = eval_reward(recipe_mod.from_dict({"rollout": {"reward": "model", "reward_model": rm}}))
    assert isinstance(same, CombinedReward) and score(same, "abcd") not in (0.0, 1.0)
