"""The doctor's check of the sampler's logprob semantics, checked rather than assumed: each SGLang
server reached samples a few tokens at the recipe's sampling parameters, and the learner's own code
scores the same tokens at T and at 1. A server run with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
(slime's launch scripts set it) reports the untempered ones, and at T != 1 every token would look
off-policy; a server with other weights matches neither (:func:`judge_logprobs`)."""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile

from asyncrl import recipe as recipe_mod
from asyncrl.doctor.context import Check, Doctor
from asyncrl.memory import gib

PROBE_PROMPT_TOKENS, PROBE_NEW_TOKENS = 16, 32
"""The logprob check's prompt (a fixed draw of token ids) and how many tokens it samples."""

LOGPROB_TOL = 0.1
"""Mean |server − learner| logprob (nats) over the sampled tokens within which a server's logprobs
are the learner's, kernels and dtypes apart: float32 on both sides differ by ~2e-7 and a bfloat16
learner against a float32 engine by ~2e-3 (the tiny test model). It only separates "other weights"
from the rest: whether a server tempers its logprobs is read from which of log softmax(z/T) and
log softmax(z) it is closer to (:func:`judge_logprobs`), as far as the noise allows."""


def check_logprobs(d: Doctor) -> list[Check]:
    """Each server reached (:func:`~asyncrl.doctor.generators.check_generators`) samples
    :data:`PROBE_NEW_TOKENS` tokens at the recipe's sampling parameters, and the learner's own
    code (a one-rank :class:`~asyncrl.learner.trainer.Trainer` on ``model.path``, forward only)
    computes log softmax(z/T) and log softmax(z) of the same tokens. One check per server."""
    from asyncrl.generator_http import GeneratorError, call, sync_client
    from asyncrl.rollout.sglang_protocol import (
        SamplingParams,
        generate_payload,
        output_token_logprobs,
    )

    r = d.recipe
    if r.generator.kind != "sglang" or not r.algorithm.uses_rollouts:
        return []
    urls = [u for u in r.generator.urls if u in d.servers]  # the reachable ones
    if not urls:
        return []
    if d.dims is None:
        return [Check(name="logprobs", ok=False, detail="cannot tell without the model")]
    need = d.dims.params * 4  # TorchTitan keeps float32 parameters whatever model.dtype
    if d.device is not None and need > d.device.learner_memory:
        where = "the smallest GPU" if d.device.cuda else "the host"
        return [
            Check(
                name="logprobs",
                ok=True,
                detail=f"not checked: the model's float32 parameters ({gib(need)} GiB) do not "
                f"fit {where} ({gib(d.device.learner_memory)} GiB free) in one process",
            )
        ]
    prompt = probe_prompt(d.dims.vocab)
    params = dataclasses.replace(SamplingParams.from_recipe(r.rollout), stop=[], ignore_eos=True)
    out: dict[str, Check] = {}
    sampled: dict[str, tuple[list[int], list[float]]] = {}
    with sync_client(d.timeout_s) as http:
        for url in urls:
            rid = f"asyncrl-doctor-{os.getpid()}-{len(sampled)}"
            body = generate_payload(prompt, params, max_new_tokens=PROBE_NEW_TOKENS, rid=rid)
            try:
                sampled[url] = output_token_logprobs(call(http, url, "POST", "/generate", body))
            except GeneratorError as e:
                out[url] = Check(name=f"logprobs {url}", ok=False, detail=f"could not sample: {e}")
    if sampled:
        t = r.rollout.logprob_temperature
        learner = learner_logprobs(d, prompt, [ids for ids, _ in sampled.values()])
        for (url, (_, lps)), (tempered, plain) in zip(sampled.items(), learner, strict=True):
            ok, detail = judge_logprobs(lps, tempered, plain, temperature=t)
            out[url] = Check(name=f"logprobs {url}", ok=ok, detail=detail)
    return [out[u] for u in urls]


def learner_logprobs(
    d: Doctor, prompt: list[int], completions: list[list[int]]
) -> list[tuple[list[float], list[float]]]:
    """(log softmax(z/T), log softmax(z)) of each completion's tokens after ``prompt``, from the
    learner's model and logprob code on one rank, T the recipe's logprob temperature."""
    import numpy as np

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.packing import make_sequence, pack
    from asyncrl.learner.trainer import Trainer

    r = d.recipe
    t = r.rollout.logprob_temperature
    seq_len = max(r.model.max_seq_len, PROBE_PROMPT_TOKENS + PROBE_NEW_TOKENS)
    with tempfile.TemporaryDirectory(prefix="asyncrl-doctor-") as tmp:
        one_rank = recipe_mod.from_dict(
            {
                "model": {
                    "path": str(r.resolve(r.model.path)),
                    "dtype": r.model.dtype,
                    "attention": r.model.attention,
                    "max_seq_len": seq_len,
                },
                "rollout": {"temperature": t},
                "run": {"output_dir": tmp},
            }
        )
        trainer = Trainer(TrainerConfig.from_recipe(one_rank), checkpointing=False, run_dir=tmp)
        try:
            out = []
            for ids in completions:
                mb = pack([make_sequence(0, np.array(prompt), np.array(ids))])
                both = []
                for temperature in (t, 1.0):
                    trainer.models.temperature = temperature
                    (lp,) = trainer.logprobs([mb])
                    both.append(lp.double().tolist())
                out.append((both[0], both[1]))
            return out
        finally:
            trainer.close()


def probe_prompt(vocab: int) -> list[int]:
    """Token ids no text would give, a fixed draw over the vocabulary: a model is unsure what
    follows them, and on such high-entropy tokens log softmax(z/T) and log softmax(z) are far apart
    (on a confident token both are near 0, and a wrong temperature would hardly show)."""
    return random.Random(0).sample(range(vocab), min(PROBE_PROMPT_TOKENS, vocab))


def judge_logprobs(
    server: list[float], tempered: list[float], plain: list[float], *, temperature: float
) -> tuple[bool, str]:
    """(ok, the verdict) on a server's logprobs of its sampled tokens against the learner's
    log softmax(z/T) (``tempered``) and log softmax(z) (``plain``) of the same tokens.

    Within :data:`LOGPROB_TOL` of neither: the server holds other weights. Otherwise the distance to
    the one it follows is the kernels' noise, and it reports untempered logprobs when it is at
    least 4 times closer to log softmax(z) than to log softmax(z/T). At T = 1 the two are one; near
    1 they may differ by less than the noise: not refused then (a wrong temperature costs no more
    than the noise), and the verdict says so."""
    n = len(server)

    def mean_gap(a: list[float], b: list[float]) -> float:
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(n, 1)

    e_t, e_1, apart = mean_gap(server, tempered), mean_gap(server, plain), mean_gap(tempered, plain)
    at = f"{n} tokens sampled at T = {temperature:g}"
    if min(e_t, e_1) > LOGPROB_TOL:
        return False, (
            f"{at}: its logprobs match neither the learner's log softmax(z/T) (mean |Δ| {e_t:.3g}) "
            f"nor log softmax(z) (mean |Δ| {e_1:.3g}), more than {LOGPROB_TOL:g} nat apart: the "
            "server holds other weights or another model than model.path (one a run already "
            "updated holds later ones): serve model.path, or point model.path at its weights"
        )
    if 4 * e_1 <= e_t:
        return False, (
            f"{at}: its logprobs equal the untempered log softmax(z) (mean |Δ| {e_1:.2g}), not the "
            f"learner's log softmax(z/T) (mean |Δ| {e_t:.2g}): it runs with "
            "SGLANG_RETURN_ORIGINAL_LOGPROB=1, and every token would look off-policy by about "
            f"{e_t:.2g} nat: relaunch it without SGLANG_RETURN_ORIGINAL_LOGPROB"
        )
    if e_t <= e_1:
        return True, (
            f"{at}: its logprobs are the learner's log softmax(z/T) (mean |Δ| {e_t:.2g}; the "
            f"untempered log softmax(z) is {apart:.2g} away)"
        )
    return True, (
        f"{at}: its logprobs are within {e_t:.2g} of the learner's log softmax(z/T), and the "
        f"untempered log softmax(z) only {apart:.2g} away from those: too close to tell which it "
        "reports, and a wrong temperature costs no more"
    )
