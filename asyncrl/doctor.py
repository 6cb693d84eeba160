"""`asyncrl doctor RECIPE [key=value ...]`: a preflight on the machine a run will use, before step 1.

One line per check, ✓ or ✗ with the fix: the recipe and its files, the devices and their memory,
the model and the attention it will train with, a memory plan per learner rank and per generator
against the device memory (:mod:`asyncrl.memory`), the SGLang servers (reachable, version, TP size,
radix cache against ``weights.pause_mode``, weight-version label, and their logprobs against the
learner's at the recipe's temperature: :meth:`Doctor.check_logprobs`), NCCL on both sides
(:mod:`asyncrl.gpu`), the ports the learner will bind, and the TLS files. On a machine without a GPU
the same checks run where they apply (host memory, gloo).

Exit codes: 0 every check passes; 2 one does not (a plan that does not fit, a server to relaunch, a
port in use...), named on the last line. Never a traceback: a check that cannot run says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import random
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncrl import gpu, memory
from asyncrl import recipe as recipe_mod
from asyncrl.memory import GiB, ModelDims, gib
from asyncrl.reach import HostError, engine_host
from asyncrl.recipe import Recipe

MIN_SGLANG = (0, 5, 19)
"""The first SGLang with per-token ``weight_versions`` spans (README "SGLang servers")."""

PROBE_PROMPT_TOKENS, PROBE_NEW_TOKENS = 16, 32
"""The logprob check's prompt (a fixed draw of token ids) and how many tokens it samples."""

LOGPROB_TOL = 0.1
"""Mean |server − learner| logprob (nats) over the sampled tokens within which a server's logprobs
are the learner's, kernels and dtypes apart: float32 on both sides differ by ~2e-7 and a bfloat16
learner against a float32 engine by ~2e-3 (the tiny test model). It only separates "other weights"
from the rest: whether a server tempers its logprobs is read from which of log softmax(z/T) and
log softmax(z) it is closer to (:func:`judge_logprobs`), as far as the noise allows."""


@dataclass(frozen=True, kw_only=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class Device:
    """Where learner ranks run: the visible GPUs' free memory, or the host's available RAM."""

    cuda: bool
    gpus: list[tuple[str, int, int, tuple[int, int]]]  # (name, free, total, capability)
    host_available: int
    host_total: int

    @property
    def learner_memory(self) -> int:
        return min(free for _, free, _, _ in self.gpus) if self.cuda else self.host_available


@dataclass(kw_only=True)
class Doctor:
    """Runs the checks (:data:`CHECKS`) for one recipe. ``sglang_python``: SGLang's own
    interpreter, when it lives in another environment, to read its NCCL."""

    recipe: Recipe
    sglang_python: str = ""
    timeout_s: float = 10.0
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    checks: list[Check] = field(default_factory=list)
    dims: ModelDims | None = None
    device: Device | None = None
    servers: dict[str, dict] = field(default_factory=dict)  # url -> /server_info (or {})

    def run(self, emit: Callable[[Check], None] = lambda c: None) -> list[Check]:
        for name, check in CHECKS:
            try:
                results = check(self)
            except Exception as e:  # a check that cannot run is a failed check, not a traceback
                results = [Check(name=name, ok=False, detail=f"could not run: {e!r}")]
            for c in results:
                self.checks.append(c)
                emit(c)
        return self.checks

    # ---- recipe, files, device, model --------------------------------------------------------

    def check_files(self) -> list[Check]:
        try:
            recipe_mod.validate(self.recipe, check_files=True)
        except recipe_mod.RecipeError as e:
            return [Check(name="files", ok=False, detail=str(e))]
        return [Check(name="files", ok=True, detail="model, data and TLS files exist")]

    def check_device(self) -> list[Check]:
        import torch

        total, available = host_memory()
        gpus = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, tot = torch.cuda.mem_get_info(i)
                name = torch.cuda.get_device_name(i)
                gpus.append((name, free, tot, torch.cuda.get_device_capability(i)))
        self.device = Device(cuda=bool(gpus), gpus=gpus, host_available=available, host_total=total)
        host = f"host RAM {gib(available)} GiB available of {gib(total)} GiB"
        if not gpus:
            return [
                Check(
                    name="device",
                    ok=True,
                    detail=f"no GPU: a CPU run, {os.cpu_count()} cores, {host}",
                )
            ]
        listed = "; ".join(
            f"{i}: {n} (sm {c[0]}{c[1]}), {gib(f)} GiB free of {gib(t)}"
            for i, (n, f, t, c) in enumerate(gpus)
        )
        return [Check(name="device", ok=True, detail=f"{len(gpus)} GPUs: {listed}; {host}")]

    def check_model(self) -> list[Check]:
        from asyncrl.learner.model import ModelConfigError, build_spec, read_hf_config

        path = self.recipe.resolve(self.recipe.model.path)
        try:
            cfg = read_hf_config(path)
            self.dims = ModelDims.from_hf_config(cfg)
            spec = build_spec(path, attention="auto", max_seq_len=1)  # attention below
            if self.recipe.learner.lora.enabled:
                from asyncrl.learner.lora import check_supported

                check_supported(spec.name)
        except (ModelConfigError, memory.PlanError) as e:
            return [Check(name="model", ok=False, detail=str(e))]
        d = self.dims
        tied = "tied" if d.tied else "untied"
        return [
            Check(
                name="model",
                ok=True,
                detail=f"{d.arch}, {_count(d.params)} parameters (hidden {d.hidden}, "
                f"{d.layers} layers, {d.heads}/{d.kv_heads} heads, vocabulary {d.vocab:,}, "
                f"{tied} embeddings)",
            )
        ]

    def check_attention(self) -> list[Check]:
        from asyncrl.learner import cpu_shims
        from asyncrl.learner.attention import choose_attention, module_importable
        from asyncrl.learner.model import ModelConfigError, build_spec

        if self.dims is None:
            return [Check(name="attention", ok=False, detail="cannot tell without the model")]
        kind = self.recipe.model.attention
        on_cpu = cpu_shims.ON_CPU
        try:  # what the learner will refuse (flex or varlen on CPU, varlen without its kernels)
            build_spec(self.recipe.resolve(self.recipe.model.path), attention=kind, max_seq_len=1)
        except ModelConfigError as e:
            return [Check(name="attention", ok=False, detail=str(e))]
        cap = None if on_cpu or not self.device or not self.device.gpus else self.device.gpus[0][3]
        try:
            chosen, why = choose_attention(
                kind, on_cpu=on_cpu, capability=cap, importable=module_importable
            )
        except ValueError as e:
            return [Check(name="attention", ok=False, detail=str(e))]
        return [Check(name="attention", ok=True, detail=f"{chosen}: {why}")]

    # ---- generators --------------------------------------------------------------------------

    def check_generators(self) -> list[Check]:
        from asyncrl.engine.sampling import ORIGINAL_LOGPROB_ENV, original_logprob

        g = self.recipe.generator
        if g.kind == "builtin":
            n = self.recipe.rollout.workers * g.engines_per_worker
            line = (
                f"built-in engines: {n} started by the rollout workers "
                f"({self.recipe.rollout.workers} × {g.engines_per_worker}), nothing to reach"
            )
            t = self.recipe.rollout.logprob_temperature
            if self.recipe.algorithm.uses_rollouts and t != 1.0 and original_logprob(self.environ):
                return [
                    Check(
                        name="generators",
                        ok=False,
                        detail=f"{ORIGINAL_LOGPROB_ENV}={self.environ[ORIGINAL_LOGPROB_ENV]} here: "
                        "the built-in engines inherit it and, as SGLang does, report logprobs "
                        f"before the temperature, so at rollout.temperature {t:g} every token "
                        f"looks off-policy: unset {ORIGINAL_LOGPROB_ENV}",
                    )
                ]
            return [Check(name="generators", ok=True, detail=line)]
        return [self._check_server(url) for url in g.urls]

    def _check_server(self, url: str) -> Check:
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
            async with async_client(self.timeout_s) as http:
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
        self.servers[url] = server
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
                facts.append(f"tp {server_ranks(server)}")
            except LayoutError as e:
                problems.append(str(e))
            radix_off = bool(server.get("disable_radix_cache", False))
            facts.append("radix cache off" if radix_off else "radix cache on")
            radix = radix_cache_problem(server, self.recipe.weights.pause_mode)
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

    def check_logprobs(self) -> list[Check]:
        """The sampler's logprob semantics, checked rather than assumed: each server reached above
        samples :data:`PROBE_NEW_TOKENS` tokens at the recipe's sampling parameters, and the
        learner's own code (a one-rank :class:`~asyncrl.learner.trainer.Trainer` on
        ``model.path``, forward only) computes log softmax(z/T) and log softmax(z) of the same
        tokens. A server run with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (slime's launch scripts set
        it) reports the untempered ones, and at T != 1 every token would look off-policy; a server
        with other weights matches neither. One check per server."""
        from asyncrl.generator_http import GeneratorError, call, sync_client
        from asyncrl.rollout.sglang_protocol import (
            SamplingParams,
            generate_payload,
            output_token_logprobs,
        )

        r = self.recipe
        if r.generator.kind != "sglang" or not r.algorithm.uses_rollouts:
            return []
        urls = [u for u in r.generator.urls if u in self.servers]  # the reachable ones
        if not urls:
            return []
        if self.dims is None:
            return [Check(name="logprobs", ok=False, detail="cannot tell without the model")]
        need = self.dims.params * 4  # TorchTitan keeps float32 parameters whatever model.dtype
        if self.device is not None and need > self.device.learner_memory:
            where = "the smallest GPU" if self.device.cuda else "the host"
            return [
                Check(
                    name="logprobs",
                    ok=True,
                    detail=f"not checked: the model's float32 parameters ({gib(need)} GiB) do not "
                    f"fit {where} ({gib(self.device.learner_memory)} GiB free) in one process",
                )
            ]
        prompt = probe_prompt(self.dims.vocab)
        params = dataclasses.replace(
            SamplingParams.from_recipe(r.rollout), stop=[], ignore_eos=True
        )
        out: dict[str, Check] = {}
        sampled: dict[str, tuple[list[int], list[float]]] = {}
        with sync_client(self.timeout_s) as http:
            for url in urls:
                rid = f"asyncrl-doctor-{os.getpid()}-{len(sampled)}"
                body = generate_payload(prompt, params, max_new_tokens=PROBE_NEW_TOKENS, rid=rid)
                try:
                    sampled[url] = output_token_logprobs(call(http, url, "POST", "/generate", body))
                except GeneratorError as e:
                    out[url] = Check(
                        name=f"logprobs {url}", ok=False, detail=f"could not sample: {e}"
                    )
        if sampled:
            t = r.rollout.logprob_temperature
            learner = self.learner_logprobs(prompt, [ids for ids, _ in sampled.values()])
            for (url, (_, lps)), (tempered, plain) in zip(sampled.items(), learner, strict=True):
                ok, detail = judge_logprobs(lps, tempered, plain, temperature=t)
                out[url] = Check(name=f"logprobs {url}", ok=ok, detail=detail)
        return [out[u] for u in urls]

    def learner_logprobs(
        self, prompt: list[int], completions: list[list[int]]
    ) -> list[tuple[list[float], list[float]]]:
        """(log softmax(z/T), log softmax(z)) of each completion's tokens after ``prompt``, from the
        learner's model and logprob code on one rank, T the recipe's logprob temperature."""
        import numpy as np

        from asyncrl.learner.config import TrainerConfig
        from asyncrl.learner.packing import make_sequence, pack
        from asyncrl.learner.trainer import Trainer

        r = self.recipe
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

    # ---- memory ------------------------------------------------------------------------------

    # Bindings of the recipe's plan (asyncrl.memory) to what the checks above found: the model's
    # dims, the device, the servers' TP sizes; and the learner's logits chunk sizing, which the
    # plan's floor does not import.

    def learner_plans(self, **changes: Any) -> tuple[memory.LearnerPlan, memory.LearnerPlan]:
        from asyncrl.learner.logprobs import chunk_tokens

        assert self.dims is not None
        return memory.learner_plans_for(self.dims, self.recipe, chunk_tokens, **changes)

    def rank_plans(self, **changes: Any) -> list[memory.RankPlan]:
        from asyncrl.learner.logprobs import chunk_tokens

        assert self.dims is not None
        return memory.rank_plans_for(self.dims, self.recipe, chunk_tokens, **changes)

    def generator_plan(self) -> memory.GeneratorPlan | None:
        assert self.dims is not None
        g = self.recipe.generator
        tps = [self.servers[u].get("tp_size", 1) for u in g.urls if self.servers.get(u)]
        return memory.generator_plan_for(self.dims, self.recipe, cuda=self.cuda, server_tps=tps)

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.cuda

    def engines_on_gpu(self) -> int:
        return memory.engines_on_gpu(self.recipe, cuda=self.cuda)

    def learner_need(self, **changes: Any) -> tuple[int, int]:
        """(bytes the learner needs where it is compared, bytes there). On a GPU: the fullest
        rank's peak with placement (:meth:`rank_plans`) against the smallest free GPU memory. On CPU every rank, every built-in engine and one
        runtime per process share the host's available RAM."""
        assert self.device is not None
        rank0, _ = self.learner_plans(**changes)
        plans = self.rank_plans(**changes)
        if self.device.cuda:
            engines = memory.engines_gpu_bytes(self.dims, self.recipe, cuda=True)  # rank 0's GPU
            return max(p.peak + (engines if p.rank == 0 else 0) for p in plans), (
                self.device.learner_memory
            )
        ranks = self.recipe.learner.ranks
        need = sum(p.peak_without_offload for p in plans) + ranks * rank0.checkpoint_staging
        return need + self.engines_need(), self.device.host_available

    def engines_need(self) -> int:
        """Host bytes of the built-in engines and of every process's runtime on the host; on a GPU
        machine also the learner ranks' asynchronous checkpoint staging (host memory)."""
        gen = self.generator_plan() if self.dims is not None else None
        engines = memory.engines_here(self.recipe)
        gpu_ranks = min(self.recipe.learner.ranks, len(self.device.gpus)) if self.device else 0
        ranks = self.recipe.learner.ranks if not gpu_ranks else 0
        gen_total = gen.total if gen is not None and engines else 0
        on_host = engines - self.engines_on_gpu()  # the others hold their tensors on the GPU
        staging = self.learner_plans()[0].checkpoint_staging * gpu_ranks if self.dims else 0
        return on_host * gen_total + (ranks + engines) * runtime_bytes() + staging

    def check_learner_memory(self) -> list[Check]:
        if self.dims is None or self.device is None:
            return [Check(name="learner memory", ok=False, detail="no plan without the model")]
        r = self.recipe
        rank0, _ = self.learner_plans()
        parts = " + ".join(f"{k} {gib(v)}" for k, v in rank0.items())
        if rank0.checkpoint_staging:
            parts += f" (+ async checkpoint staging {gib(rank0.checkpoint_staging)} on the host)"
        ac = r.learner.activation_checkpointing
        what = f"(activations: {rank0.tokens:,} tokens, checkpointing {ac})"
        if r.learner.lora.enabled:
            adapters = memory.lora_params(self.dims, r.learner)
            what += (
                f" (LoRA rank {r.learner.lora.rank}: {adapters / 1e6:.1f} M adapter params train)"
            )
        need, have = self.learner_need()
        if self.device.cuda:
            where = f"{gib(have)} GiB free on the smallest GPU"
        else:
            where = (
                f"{gib(have)} GiB available on the host, with {r.learner.ranks} rank(s), "
                f"{memory.engines_here(r)} built-in engine(s) and a runtime each"
            )
        line = f"rank 0 needs {gib(rank0.total)} GiB = {parts} {what}"
        if self.placed():
            top = max(self.rank_plans(), key=lambda p: p.peak)
            line = (
                f"with placement the fullest rank, {top.rank}, needs {gib(top.peak)} GiB at its "
                f"peak ({top.peak_phase or 'between calls'}; per rank below) {what}"
            )
        beside = memory.engines_gpu_bytes(self.dims, r, cuda=self.cuda)
        if beside:
            line += (
                f"; beside it on its GPU {self.engines_on_gpu()} built-in engine(s), "
                f"{gib(beside)} GiB (generator memory)"
            )
        line += f"; in all {gib(need)} GiB of {where}"
        if need > have:
            return [
                Check(name="learner memory", ok=False, detail=f"{line}; {self.fixes(need, have)}")
            ]
        host = self.engines_need()
        if self.device.cuda and host > self.device.host_available:
            return [
                Check(
                    name="learner memory",
                    ok=False,
                    detail=f"{line}; but the host needs {gib(host)} GiB of its "
                    f"{gib(self.device.host_available)} GiB (checkpoint staging, engines, runtimes): "
                    "set learner.checkpoint_async=false",
                )
            ]
        return [Check(name="learner memory", ok=True, detail=line)]

    def placed(self) -> bool:
        """Whether the recipe places a role other than every role on every rank with FSDP only."""
        return self.recipe.placement != recipe_mod.PlacementConfig()

    def check_placement(self) -> list[Check]:
        """Each role's ranks and layout, then each group of ranks alike: its roles' states and its
        peak over the step's phases, with and without reallocation (``offload``)."""
        if self.dims is None or self.device is None:
            return [Check(name="placement", ok=False, detail="no plan without the model")]
        layouts = memory.role_layouts(self.recipe)
        said = "; ".join(lay.describe() for lay in layouts)
        asked = [x for x in ("critic", "ref") if getattr(self.recipe.placement, x).offload]
        if self.recipe.placement.actor.offload:
            said += "; placement.actor.offload is not done (the actor is published between steps)"
        if asked and not self.device.cuda:
            said += "; on CPU nothing is offloaded (the device is host memory): a CPU run needs "
            said += "the peaks without offload"
        out = [Check(name="placement", ok=True, detail=said)]
        groups: dict[tuple, list[memory.RankPlan]] = {}
        for p in self.rank_plans():
            key = (p.roles, tuple(p.states.items()), tuple(p.phases.items()), p.weight_snapshot)
            groups.setdefault(key, []).append(p)
        have = self.device.learner_memory
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
            if self.device.cuda and p.peak > have:
                detail += f"; does not fit the smallest GPU's {gib(have)} GiB free"
                out.append(Check(name=name, ok=False, detail=detail))
            else:
                out.append(Check(name=name, ok=True, detail=detail))
        return out

    def fixes(self, need: int, have: int) -> str:
        """What to change so that the learner fits, each priced with the same plan."""
        r = self.recipe
        rank0, _ = self.learner_plans()
        name, size = max(rank0.items(), key=lambda kv: kv[1])
        largest = f"{name} {gib(size)} GiB"
        if self.placed():  # the fullest rank's largest role
            top = max(self.rank_plans(), key=lambda p: p.peak)
            name, size = max(top.states.items(), key=lambda kv: kv[1])
            largest = f"{name} states {gib(size)} GiB on rank {top.rank}"
        out = []
        if r.learner.activation_checkpointing != "full":
            need_full, _ = self.learner_need(activation_checkpointing="full")
            if need_full <= have:
                out.append(f"set learner.activation_checkpointing=full ({gib(need_full)} GiB)")
        if r.learner.checkpoint_async and not self.device.cuda:
            need_sync, _ = self.learner_need(checkpoint_async=False)
            if need_sync <= have:
                out.append(f"set learner.checkpoint_async=false ({gib(need_sync)} GiB)")
        lo, hi = r.model.max_seq_len, min(r.learner.micro_batch_tokens, rank0.tokens) - 1
        if lo <= hi and self.learner_need(micro_batch_tokens=lo)[0] <= have:
            while lo < hi:  # the largest micro-batch that fits (the need grows with it)
                mid = (lo + hi + 1) // 2
                lo, hi = (
                    (mid, hi)
                    if self.learner_need(micro_batch_tokens=mid)[0] <= have
                    else (lo, mid - 1)
                )
            out.append(f"set learner.micro_batch_tokens={lo}")
        gen = self.generator_plan() if self.engines_on_gpu() else None
        if gen is not None and gen.kv_cache:  # the engines' share of rank 0's GPU
            out.append(
                f"a smaller generator.max_batch_size (the engines' slots hold "
                f"{gib(self.engines_on_gpu() * gen.kv_cache)} GiB of its GPU)"
            )
        if not out:
            out.append(
                "more learner ranks (FSDP shards params, grads and AdamW), "
                "learner.activation_checkpointing=full, or a shorter model.max_seq_len"
            )
        return f"does not fit by {gib(need - have)} GiB (largest: {largest}): " + "; or ".join(out)

    def check_generator_memory(self) -> list[Check]:
        if self.dims is None or self.device is None:
            return [Check(name="generator memory", ok=False, detail="no plan without the model")]
        gen = self.generator_plan()
        if gen is None:
            return [Check(name="generator memory", ok=True, detail="sft: no generators")]
        r = self.recipe
        parts = " + ".join(f"{k} {gib(v)}" for k, v in gen.items())
        seqs = f"{gen.sequences} sequences × {gen.tokens_per_sequence} tokens"
        if r.generator.kind == "builtin" and self.engines_on_gpu():
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
            host_need = self.engines_need() if self.device.cuda else alone
            if host_need > self.device.host_available:
                line += (
                    f"; {engines} of them do not fit the host's "
                    f"{gib(self.device.host_available)} GiB: lower generator.max_batch_size or "
                    "generator.engines_per_worker"
                )
                return [Check(name="generator memory", ok=False, detail=line)]
            return [Check(name="generator memory", ok=True, detail=line)]
        line = f"per GPU of each server: {gib(gen.total)} GiB = {parts} ({seqs} in flight)"
        pools = [
            s["max_total_num_tokens"]
            for s in self.servers.values()
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

    # ---- NCCL --------------------------------------------------------------------------------

    def check_nccl(self) -> list[Check]:
        cuda = bool(self.device and self.device.cuda)
        backend = self.recipe.weights.backend
        here = gpu.this_torch()
        mine = f"torch {here.torch}, NCCL {gpu.format_nccl(here.nccl)}"
        other = self._sglang_side()
        g = self.recipe.generator
        gloo_member = gpu.recipe_needs_gloo(g.kind, g.device, cuda=cuda)
        if not gpu.uses_nccl(backend, cuda=cuda, gloo_member=gloo_member):
            why = f"weights.backend {backend}" + (
                ", built-in engines receive on CPU" if gloo_member and backend == "auto" else ""
            )
            how = "by handle" if backend == "ipc" else "over gloo"
            detail = f"not used: weights go {how} ({why}); here {mine}"
            return [Check(name="NCCL", ok=True, detail=detail + (f"; {other[1]}" if other else ""))]
        if not cuda:
            return [
                Check(
                    name="NCCL",
                    ok=False,
                    detail=f"weights.backend nccl needs a GPU and this machine has none ({mine}): "
                    "run it on the GPU machine, or set weights.backend=gloo",
                )
            ]
        bad_env = gpu.nccl_env_mismatch(self.environ)
        if bad_env:
            return [
                Check(
                    name="NCCL",
                    ok=False,
                    detail=f"{', '.join(bad_env)} here, but SGLang servers run with "
                    f"{gpu.SGLANG_NCCL_ENV} unless launched with the same: unset it, or set it "
                    "for the servers too",
                )
            ]
        if other is None and g.kind == "builtin":
            detail = (
                f"learner {mine}; built-in engines on CUDA (generator.device {g.device}) join "
                "NCCL from another GPU, and take CUDA IPC handles on rank 0's own (NCCL refuses "
                "two ranks on one GPU; weights.backend ipc): the broadcaster chooses at each "
                "group build from what they report"
            )
            return [Check(name="NCCL", ok=True, detail=detail)]
        if other is None:
            return [Check(name="NCCL", ok=True, detail=f"learner {mine}; no SGLang servers")]
        theirs, text = other
        if theirs is None:
            return [Check(name="NCCL", ok=True, detail=f"learner {mine}; {text}")]
        if theirs != here.nccl:
            return [
                Check(
                    name="NCCL",
                    ok=False,
                    detail=f"learner {mine}, but {text}: NCCL refuses mismatched versions; "
                    "install the learner on SGLang's torch (pip install 'asyncrl[gpu]', docs/gpu.md)",
                )
            ]
        return [Check(name="NCCL", ok=True, detail=f"learner {mine}; {text}: the same")]

    def _sglang_side(self) -> tuple[gpu.NcclVersion | None, str] | None:
        """(the servers' NCCL if it can be read or inferred, how it was found); None: no SGLang."""
        if self.sglang_python:
            try:
                t = gpu.probe_python(self.sglang_python)
            except RuntimeError as e:
                return None, f"SGLang's environment: {e}"
            return t.nccl, f"SGLang's environment torch {t.torch}, NCCL {gpu.format_nccl(t.nccl)}"
        if self.recipe.generator.kind != "sglang":
            return None
        import importlib.metadata as md

        try:
            v = md.version("sglang")
            here = gpu.this_torch()
            return here.nccl, f"SGLang {v} installed in this environment: the same torch"
        except md.PackageNotFoundError:
            pass
        versions = {str(s.get("version")) for s in self.servers.values() if s.get("version")}
        if len(versions) == 1:
            (v,) = versions
            expected = gpu.expected_nccl(v)
            if expected is not None:
                return expected, (
                    f"servers run sglang {v}, which pins torch {gpu.SGLANG_TORCH[v]}: NCCL "
                    f"{gpu.format_nccl(expected)} if installed as pinned (not readable over HTTP; "
                    "--sglang-python reads it)"
                )
        return None, "the servers' NCCL cannot be read over HTTP: --sglang-python PATH reads it"

    # ---- ports and TLS -----------------------------------------------------------------------

    def check_ports(self) -> list[Check]:
        r = self.recipe
        wanted: list[tuple[str, str, int]] = []
        for key in ("address", "pub_address"):
            a = getattr(r.buffer, key)
            if a.startswith(("tcp://", "tls+tcp://")):
                u = urlsplit(a)
                wanted.append((f"buffer.{key}", u.hostname or "", u.port or 0))
        wanted.append(("weights.master_port", r.weights.master_addr, r.weights.master_port))
        if r.generator.kind == "builtin" and r.generator.base_port:
            n = r.rollout.workers * r.generator.engines_per_worker
            try:
                host = engine_host(r.generator.host, r.buffer.address)
            except HostError:  # the worker refuses it (one line); here only its ports count
                host = r.generator.host
            for i in range(n):
                wanted.append(("generator.base_port", host, r.generator.base_port + i))
        busy, elsewhere, free = [], [], []
        for key, host, port in wanted:
            if port == 0:
                continue
            state = port_state(host, port)
            (busy if state == "busy" else elsewhere if state == "remote" else free).append(
                f"{key} {host}:{port}"
            )
        if busy:
            return [
                Check(
                    name="ports",
                    ok=False,
                    detail=f"in use: {', '.join(busy)}: stop what holds them, or choose other "
                    "ports (0: a free one at start)",
                )
            ]
        said = [f"free: {', '.join(free)}" if free else "", "port 0: a free one at start"]
        if elsewhere:
            said.append(f"not this host's (checked where they run): {', '.join(elsewhere)}")
        return [Check(name="ports", ok=True, detail="; ".join(s for s in said if s))]

    def check_tls(self) -> list[Check]:
        import ssl

        from asyncrl.transport import TLS

        tls = TLS.from_config(self.recipe)
        if tls is None:
            return [Check(name="TLS", ok=True, detail="not used (tcp:// addresses)")]
        try:
            tls.server_config()  # what the buffer service builds (reads and parses the PEM files)
            tls.client_config(self.recipe.buffer.address)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_cert_chain(tls.cert, tls.key)  # the key is the certificate's
            ctx.load_verify_locations(tls.ca)
        except (ValueError, OSError, ssl.SSLError) as e:
            return [Check(name="TLS", ok=False, detail=f"{e}: fix buffer.tls (docs/multinode.md)")]
        except Exception as e:  # pynng's own errors for PEM it cannot parse
            return [
                Check(name="TLS", ok=False, detail=f"{e!r}: fix buffer.tls (docs/multinode.md)")
            ]
        return [
            Check(
                name="TLS",
                ok=True,
                detail=f"certificate, key (its own) and CA readable: {tls.cert}, {tls.key}, {tls.ca}",
            )
        ]


CHECKS: tuple[tuple[str, Callable[[Doctor], list[Check]]], ...] = (
    ("files", Doctor.check_files),
    ("device", Doctor.check_device),
    ("model", Doctor.check_model),
    ("attention", Doctor.check_attention),
    ("generators", Doctor.check_generators),
    ("logprobs", Doctor.check_logprobs),
    ("learner memory", Doctor.check_learner_memory),
    ("placement", Doctor.check_placement),
    ("generator memory", Doctor.check_generator_memory),
    ("NCCL", Doctor.check_nccl),
    ("ports", Doctor.check_ports),
    ("TLS", Doctor.check_tls),
)
"""What :meth:`Doctor.run` checks, in order: a check reads what those before it found (the model's
dims, the device, the servers reached). The name is the failed line's when a check cannot run."""


# ---- helpers ---------------------------------------------------------------------------------


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


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


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes: /proc/meminfo's MemTotal and MemAvailable."""
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            fields[k] = int(v.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def runtime_bytes() -> int:
    """One process's runtime before any model: this process's resident memory once it has
    imported torch and TorchTitan (as every learner rank and engine does)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return GiB // 2


def port_state(host: str, port: int) -> str:
    """ "free", "busy" (something listens there) or "remote" (``host`` is not this machine's)."""
    try:
        infos = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "remote"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return "busy" if e.errno == errno.EADDRINUSE else "remote"
    return "free"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl doctor", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.ranks=8")
    p.add_argument(
        "--sglang-python",
        default="",
        help="SGLang's interpreter when it has its own environment: its NCCL is read from it",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per server request")
    a = p.parse_args(argv)
    try:
        r = recipe_mod.load(a.recipe, a.overrides, check_files=False)
    except recipe_mod.RecipeError as e:
        print(f"✗ recipe: {e}")
        print("asyncrl doctor: the recipe is invalid: fix it first", file=sys.stderr)
        return 2
    print(f"✓ recipe: {a.recipe} is valid")
    doctor = Doctor(recipe=r, sglang_python=a.sglang_python, timeout_s=a.timeout)
    checks = doctor.run(
        emit=lambda c: print(f"{'✓' if c.ok else '✗'} {c.name}: {c.detail}", flush=True)
    )
    failed = [c.name for c in checks if not c.ok]
    if failed:
        n = len(checks) + 1
        print(
            f"asyncrl doctor: {len(failed)} of {n} checks fail: {', '.join(failed)}",
            file=sys.stderr,
        )
        return 2
    print(f"asyncrl doctor: all {len(checks) + 1} checks pass", file=sys.stderr)
    return 0
