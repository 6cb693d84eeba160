"""The doctor's memory checks: the learner's plan per rank against the device (with the fixes that
would make it fit, each priced with the same plan), the placement of its roles rank by rank, and
each generator's plan. The arithmetic is :mod:`asyncrl.memory`'s, bound to what the checks before
found by :class:`~asyncrl.doctor.context.Doctor`; here are the verdicts and their words."""

from __future__ import annotations

import math

from asyncrl import memory
from asyncrl import recipe as recipe_mod
from asyncrl.doctor.context import Check, Doctor
from asyncrl.memory import gib
from asyncrl.recipe import Recipe


def experts_per_rank(dims: memory.ModelDims, r: Recipe) -> str:
    """An MoE actor's experts in its plan: their float32 params, grads and AdamW on one rank.
    Without expert parallelism FSDP shards them over the actor's ranks like every other weight
    (TorchTitan's ``apply_fsdp_to_decoder``: each MoE block, experts included, is one unit), so
    this is their share of the params/grads/AdamW terms, not an addition; "" for a dense model."""
    if not dims.moe_layers:
        return ""
    ranks = len(memory.role_layouts(r)[0].ranks)  # the actor, first
    per_rank = math.ceil(memory.STATE_BYTES["actor"] * dims.experts_params / ranks)
    share = dims.experts_params / dims.params
    return (
        f" (experts, {share:.0%} of the params: {gib(per_rank)} GiB a rank of the params, grads "
        f"and AdamW, sharded by FSDP over {ranks} rank(s), no expert parallelism)"
    )


def check_learner_memory(d: Doctor) -> list[Check]:
    if d.dims is None or d.device is None:
        return [Check(name="learner memory", ok=False, detail="no plan without the model")]
    r = d.recipe
    rank0, _ = d.learner_plans()
    parts = " + ".join(f"{k} {gib(v)}" for k, v in rank0.items())
    if rank0.checkpoint_staging:
        parts += f" (+ async checkpoint staging {gib(rank0.checkpoint_staging)} on the host)"
    ac = r.learner.activation_checkpointing
    what = f"(activations: {rank0.tokens:,} tokens, checkpointing {ac})"
    if r.learner.lora.enabled:
        adapters = memory.lora_params(d.dims, r.learner)
        what += f" (LoRA rank {r.learner.lora.rank}: {adapters / 1e6:.1f} M adapter params train)"
    what += experts_per_rank(d.dims, r)
    need, have = d.learner_need()
    if d.device.cuda:
        where = f"{gib(have)} GiB free on the smallest GPU"
    else:
        where = (
            f"{gib(have)} GiB available on the host, with {r.learner.ranks} rank(s), "
            f"{memory.engines_here(r)} built-in engine(s) and a runtime each"
        )
    line = f"rank 0 needs {gib(rank0.total)} GiB = {parts} {what}"
    if placed(d.recipe):
        top = max(d.rank_plans(), key=lambda p: p.peak)
        line = (
            f"with placement the fullest rank, {top.rank}, needs {gib(top.peak)} GiB at its "
            f"peak ({top.peak_phase or 'between calls'}; per rank below) {what}"
        )
    beside = memory.engines_gpu_bytes(d.dims, r, cuda=d.cuda)
    if beside:
        line += (
            f"; beside it on its GPU {d.engines_on_gpu()} built-in engine(s), "
            f"{gib(beside)} GiB (generator memory)"
        )
    line += f"; in all {gib(need)} GiB of {where}"
    if need > have:
        return [Check(name="learner memory", ok=False, detail=f"{line}; {fixes(d, need, have)}")]
    host = d.engines_need()
    if d.device.cuda and host > d.device.host_available:
        return [
            Check(
                name="learner memory",
                ok=False,
                detail=f"{line}; but the host needs {gib(host)} GiB of its "
                f"{gib(d.device.host_available)} GiB (checkpoint staging, engines, runtimes): "
                "set learner.checkpoint_async=false",
            )
        ]
    return [Check(name="learner memory", ok=True, detail=line)]


def fixes(d: Doctor, need: int, have: int) -> str:
    """What to change so that the learner fits, each priced with the same plan."""
    r = d.recipe
    rank0, _ = d.learner_plans()
    name, size = max(rank0.items(), key=lambda kv: kv[1])
    largest = f"{name} {gib(size)} GiB"
    if placed(d.recipe):  # the fullest rank's largest role
        top = max(d.rank_plans(), key=lambda p: p.peak)
        name, size = max(top.states.items(), key=lambda kv: kv[1])
        largest = f"{name} states {gib(size)} GiB on rank {top.rank}"
    out = []
    if r.learner.activation_checkpointing != "full":
        need_full, _ = d.learner_need(activation_checkpointing="full")
        if need_full <= have:
            out.append(f"set learner.activation_checkpointing=full ({gib(need_full)} GiB)")
    if r.learner.checkpoint_async and not d.device.cuda:
        need_sync, _ = d.learner_need(checkpoint_async=False)
        if need_sync <= have:
            out.append(f"set learner.checkpoint_async=false ({gib(need_sync)} GiB)")
    lo, hi = r.model.max_seq_len, min(r.learner.micro_batch_tokens, rank0.tokens) - 1
    if lo <= hi and d.learner_need(micro_batch_tokens=lo)[0] <= have:
        while lo < hi:  # the largest micro-batch that fits (the need grows with it)
            mid = (lo + hi + 1) // 2
            lo, hi = (
                (mid, hi) if d.learner_need(micro_batch_tokens=mid)[0] <= have else (lo, mid - 1)
            )
        out.append(f"set learner.micro_batch_tokens={lo}")
    gen = d.generator_plan() if d.engines_on_gpu() else None
    if gen is not None and gen.kv_cache:  # the engines' share of rank 0's GPU
        out.append(
            f"a smaller generator.max_batch_size (the engines' slots hold "
            f"{gib(d.engines_on_gpu() * gen.kv_cache)} GiB of its GPU)"
        )
    if not out:
        out.append(
            "more learner ranks (FSDP shards params, grads and AdamW), "
            "learner.activation_checkpointing=full, or a shorter model.max_seq_len"
        )
    return f"does not fit by {gib(need - have)} GiB (largest: {largest}): " + "; or ".join(out)


def placed(recipe: Recipe) -> bool:
    """Whether the recipe places a role other than every role on every rank with FSDP only."""
    return recipe.placement != recipe_mod.PlacementConfig()


def check_placement(d: Doctor) -> list[Check]:
    """Each role's ranks and layout, then each group of ranks alike: its roles' states and its
    peak over the step's phases, with and without reallocation (``offload``)."""
    if d.dims is None or d.device is None:
        return [Check(name="placement", ok=False, detail="no plan without the model")]
    layouts = memory.role_layouts(d.recipe)
    said = "; ".join(lay.describe() for lay in layouts)
    asked = [x for x in ("critic", "ref") if getattr(d.recipe.placement, x).offload]
    if d.recipe.placement.actor.offload:
        said += "; placement.actor.offload is not done (the actor is published between steps)"
    if asked and not d.device.cuda:
        said += "; on CPU nothing is offloaded (the device is host memory): a CPU run needs "
        said += "the peaks without offload"
    out = [Check(name="placement", ok=True, detail=said)]
    groups: dict[tuple, list[memory.RankPlan]] = {}
    for p in d.rank_plans():
        key = (p.roles, tuple(p.states.items()), tuple(p.phases.items()), p.weight_snapshot)
        groups.setdefault(key, []).append(p)
    have = d.device.learner_memory
    for plans in groups.values():
        p = plans[0]
        name = f"rank{'s' if len(plans) > 1 else ''} {memory.span([q.rank for q in plans])}"
        if not p.roles:
            out.append(Check(name=name, ok=True, detail="no learner role: idle"))
            continue
        states = " + ".join(f"{role} {gib(b)}" for role, b in p.states.items())
        phases = "; ".join(f"{k} {gib(v)}" for k, v in p.phases.items())
        detail = f"{', '.join(p.roles)}: states {states} GiB; peak {gib(p.peak)} GiB"
        if p.peak != p.peak_without_offload:
            detail += f" with offload, {gib(p.peak_without_offload)} GiB without"
        if p.weight_snapshot:
            detail += f" (with the weight snapshot {gib(p.weight_snapshot)})"
        detail += f"; by phase: {phases}"
        if d.device.cuda and p.peak > have:
            detail += f"; does not fit the smallest GPU's {gib(have)} GiB free"
            out.append(Check(name=name, ok=False, detail=detail))
        else:
            out.append(Check(name=name, ok=True, detail=detail))
    return out


def check_generator_memory(d: Doctor) -> list[Check]:
    if d.dims is None or d.device is None:
        return [Check(name="generator memory", ok=False, detail="no plan without the model")]
    gen = d.generator_plan()
    if gen is None:
        return [Check(name="generator memory", ok=True, detail="sft: no generators")]
    r = d.recipe
    parts = " + ".join(f"{k} {gib(v)}" for k, v in gen.items())
    seqs = f"{gen.sequences} sequences × {gen.tokens_per_sequence} tokens"
    if r.generator.kind == "builtin" and d.engines_on_gpu():
        line = (
            f"each built-in engine: {gib(gen.total)} GiB = {parts} ({seqs}, {r.model.dtype}) "
            "on rank 0's GPU, priced with the learner there (learner memory); "
            "generator.max_batch_size and model.max_seq_len set its share"
        )
        return [Check(name="generator memory", ok=True, detail=line)]
    if r.generator.kind == "builtin":
        line = f"each built-in engine: {gib(gen.total)} GiB = {parts} ({seqs}, float32)"
        engines = memory.engines_here(r)
        alone = engines * gen.total  # on CPU the learner line adds the ranks
        host_need = d.engines_need() if d.device.cuda else alone
        if host_need > d.device.host_available:
            line += (
                f"; {engines} of them do not fit the host's "
                f"{gib(d.device.host_available)} GiB: lower generator.max_batch_size or "
                "generator.engines_per_worker"
            )
            return [Check(name="generator memory", ok=False, detail=line)]
        return [Check(name="generator memory", ok=True, detail=line)]
    line = f"per GPU of each server: {gib(gen.total)} GiB = {parts} ({seqs} in flight)"
    pools = [
        s["max_total_num_tokens"]
        for s in d.servers.values()
        if isinstance(s.get("max_total_num_tokens"), int)
    ]
    if pools:
        fit = min(pools) // max(gen.tokens_per_sequence, 1)
        note = (
            f"; the smallest KV pool holds {min(pools):,} tokens: {fit} of the "
            f"{gen.sequences} sequences at full length (SGLang queues the rest)"
        )
    else:
        note = "; the servers' KV pools are not reported here (SGLang sizes them itself)"
    return [Check(name="generator memory", ok=True, detail=line + note)]
