"""The teacher of on-policy distillation (``rollout.teacher``, docs/distill.md): its
log-probability of each token the student sampled, given the prompt and the tokens before it.

Asked on ``/generate`` as SGLang answers it: ``input_ids`` = prompt + completion, no new tokens
(``max_new_tokens: 0``), ``return_logprob`` with ``logprob_start_len`` = the prompt's length − 1, so
that ``meta_info.input_token_logprobs`` holds one ``[logprob, token id, text]`` for the prompt's
last token (its logprob None: SGLang computes none for the token at the start) and then one per
completion token. SGLang and the built-in engine (`asyncrl engine`) both answer it, with the
teacher's own log_softmax(logits): input logprobs are not scaled by a temperature (SGLang's, which
the built-in engine follows). So at a sampling temperature T ≠ 1 the advantage compares the
student's tempered sampler μ with the teacher's untempered distribution (docs/distill.md).

Sequences travel in batches to the teacher's servers (:mod:`asyncrl.served.server_batches`). A
sample whose teacher logprobs could not be had leaves its group as a sample whose reward failed
does (:mod:`asyncrl.rollout.group_maker`): a distillation advantage without the teacher has
nothing to be.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from asyncrl.recipe import Recipe, TeacherConfig
from asyncrl.served.server_batches import BatchedServers, require_urls

Payload = tuple[list[int], list[int]]
"""(prompt ids, completion ids) of one sequence the teacher scores."""


def parse_logprobs(body: Any, payloads: list[Payload]) -> list[np.ndarray]:
    """Each item's completion-token logprobs (float32) from a /generate answer whose input logprobs
    start at the prompt's last token (module docstring); ValueError when an item has none, a count
    or token id other than its prompt's last and its completion's, or a value that is no
    log-probability."""
    items = body if isinstance(body, list) else [body]
    if len(items) != len(payloads):
        raise ValueError(f"{len(items)} results for {len(payloads)} inputs")
    out = []
    for i, (it, (prompt, completion)) in enumerate(zip(items, payloads, strict=True)):
        meta = it.get("meta_info") if isinstance(it, dict) else None
        triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(triples, list):
            raise ValueError(f"result {i} has no meta_info.input_token_logprobs")
        if len(triples) != len(completion) + 1:
            raise ValueError(
                f"result {i}: {len(triples)} input logprobs for the prompt's last token and "
                f"{len(completion)} completion tokens"
            )
        head = triples[0]
        if not isinstance(head, list | tuple) or len(head) < 2 or head[1] != prompt[-1]:
            raise ValueError(f"result {i}: entry 0 is not the prompt's last token: {head!r}")
        lps = []
        for j, (t, tok) in enumerate(zip(triples[1:], completion, strict=True), start=1):
            if not isinstance(t, list | tuple) or len(t) < 2 or t[1] != tok:
                raise ValueError(f"result {i}: entry {j} is not [logprob, {tok}, ...]: {t!r}")
            v = t[0]
            if not isinstance(v, int | float) or not math.isfinite(v) or v > 1e-3:
                raise ValueError(f"result {i}: entry {j}: {v!r} is not a log-probability")
            lps.append(min(float(v), 0.0))
        out.append(np.asarray(lps, np.float32))
    return out


class TeacherLogprobs(BatchedServers[np.ndarray]):
    """Asks ``rollout.teacher``'s servers for the logprobs of sampled completions."""

    def __init__(self, cfg: TeacherConfig) -> None:
        super().__init__(cfg.urls, timeout_s=cfg.timeout_s, batch_size=cfg.batch_size)
        self.cfg = cfg

    def request(self, payloads: list[Payload]) -> tuple[str, dict]:
        return "/generate", {
            "input_ids": [list(p) + list(c) for p, c in payloads],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": [len(p) - 1 for p, _ in payloads],
        }

    def parse(self, answer: Any, payloads: list[Payload]) -> list[np.ndarray]:
        return parse_logprobs(answer, payloads)

    async def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int]
    ) -> tuple[np.ndarray, str]:
        """(the teacher's logprob of each completion token, failure); never raises but for
        cancellation. An empty completion has nothing to score and asks nothing."""
        if not len(completion_ids):
            return np.zeros(0, np.float32), ""
        if not len(prompt_ids):
            return np.zeros(0, np.float32), "teacher: an empty prompt's first token has no logprob"
        result, failure = await self.call((list(prompt_ids), list(completion_ids)))
        if failure:
            return np.zeros(0, np.float32), f"teacher: {failure}"
        assert result is not None
        return result, ""


def build_teacher(r: Recipe) -> TeacherLogprobs | None:
    """The recipe's teacher client (None without ``rollout.teacher``). RecipeError when it has a
    ``path`` but no ``urls`` (:func:`~asyncrl.served.server_batches.require_urls`)."""
    t = r.rollout.teacher
    if not t.enabled or not r.algorithm.uses_rollouts:
        return None
    require_urls("rollout.teacher", t.path, t.urls, "the teacher's servers")
    return TeacherLogprobs(t)
