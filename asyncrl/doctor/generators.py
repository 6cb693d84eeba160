"""The doctor's check of the recipe's generators: built-in engines (nothing to reach, but they
inherit this environment), or each SGLang server reached as the weight broadcaster reaches it, and
what would make the broadcaster refuse it (version, TP layout, radix cache, weight-version label).
The servers reached are kept in :attr:`Doctor.servers` for the checks after this one."""

from __future__ import annotations

from asyncrl.doctor.context import Check, Doctor

MIN_SGLANG = (0, 5, 19)
"""The first SGLang with per-token ``weight_versions`` spans (README "SGLang servers")."""


def check_generators(d: Doctor) -> list[Check]:
    from asyncrl.engine.sampling import ORIGINAL_LOGPROB_ENV, original_logprob

    g = d.recipe.generator
    if g.kind == "builtin":
        n = d.recipe.rollout.workers * g.engines_per_worker
        line = (
            f"built-in engines: {n} started by the rollout workers "
            f"({d.recipe.rollout.workers} × {g.engines_per_worker}), nothing to reach"
        )
        t = d.recipe.rollout.logprob_temperature
        if d.recipe.algorithm.uses_rollouts and t != 1.0 and original_logprob(d.environ):
            return [
                Check(
                    name="generators",
                    ok=False,
                    detail=f"{ORIGINAL_LOGPROB_ENV}={d.environ[ORIGINAL_LOGPROB_ENV]} here: "
                    "the built-in engines inherit it and, as SGLang does, report logprobs "
                    f"before the temperature, so at rollout.temperature {t:g} every token "
                    f"looks off-policy: unset {ORIGINAL_LOGPROB_ENV}",
                )
            ]
        return [Check(name="generators", ok=True, detail=line)]
    return [check_server(d, url) for url in g.urls]


def check_server(d: Doctor, url: str) -> Check:
    """One SGLang server's line; what it reports in ``/server_info`` is kept in ``d.servers``."""
    from asyncrl.control import ControlPlane
    from asyncrl.generator_http import (
        GeneratorError,
        WeightsClient,
        async_client,
        parse_version_label,
    )
    from asyncrl.weights.rendezvous import LayoutError, radix_cache_problem, server_ranks
    from asyncrl.wire import GeneratorInfo

    async def ask() -> tuple[dict, dict]:  # what the broadcaster asks, with its client
        async with async_client(d.timeout_s) as http:
            client = WeightsClient(GeneratorInfo(url=url), http)
            return await client.model_info(), await client.server_info() or {}

    name = f"SGLang {url}"
    plane = ControlPlane("doctor")  # the one way blocking code runs async code
    try:
        info, server = plane.run(ask)
    except GeneratorError as e:
        fix = "start it, or fix generator.urls" if e.dead else "is it an SGLang server?"
        return Check(name=name, ok=False, detail=f"{e}; {fix}")
    finally:
        plane.close()
    d.servers[url] = server
    problems, facts = [], []
    if info.get("engine") == "asyncrl":
        facts.append("asyncrl built-in engine (one rank, no radix cache)")
    else:
        version = str(server.get("version", "?"))
        facts.append(f"sglang {version}")
        if _version_tuple(version) < MIN_SGLANG:
            problems.append(
                f"sglang {version} has no per-token weight versions: use SGLang >= 0.5.19"
            )
        try:
            tp = server_ranks(server)
            facts.append(f"tp {tp}")
            if tp > 1 and d.recipe.weights.backend == "ipc":  # the broadcaster refuses it too
                problems.append(
                    f"weights.backend ipc sends one handle per bucket, which SGLang indexes by TP "
                    f"rank: a server of tp {tp} cannot take it; set weights.backend to nccl"
                )
        except LayoutError as e:
            problems.append(str(e))
        radix_off = bool(server.get("disable_radix_cache", False))
        facts.append("radix cache off" if radix_off else "radix cache on")
        radix = radix_cache_problem(server, d.recipe.weights.pause_mode)
        if radix:  # the broadcaster refuses such a server with the same words
            problems.append(radix)
    label = info.get("weight_version")
    facts.append(f"weight version {label!r}")
    if label not in (None, "default") and parse_version_label(label) is None:
        problems.append(
            f"weight version {label!r} is not a number: relaunch it with --weight-version 0"
        )
    if problems:
        return Check(name=name, ok=False, detail="; ".join(problems))
    return Check(name=name, ok=True, detail=", ".join(facts))


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)
