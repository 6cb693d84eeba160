"""LoRA's weight sync to SGLang: a version is a PEFT adapter folder each server loads by name.

With ``learner.lora`` on, a version's snapshot holds only adapter tensors
(``model.layers.{i}.self_attn.q_proj.lora_A.weight`` (r, in), ``...lora_B.weight`` (out, r)). The
built-in engine receives them over the weight group like full weights and merges them
(asyncrl/engine/lora_serving.py). SGLang serves adapters by name instead (``--enable-lora``): rank 0
writes the version's adapter as a PEFT folder (under the run folder, where a rejoining generator
already reads the exports from) and each SGLang member loads it as ``v{version}``
(``/load_lora_adapter``), then is labelled with the version (``/update_weight_version``, nothing
aborted), then lets go of the adapter two versions back (``/unload_lora_adapter``, which SGLang
holds until the requests that use it are done, so it runs in the background).

A request names its adapter when it is submitted (``lora_path``), and SGLang serves it with that
adapter to its end, whatever is loaded meanwhile: the rollout worker names ``v{label}`` (the
version the server reported last) and takes that version for every token of the response
(asyncrl/rollout/sglang_protocol.py ``parse_generate_response``), not SGLang's spans, which would move to
the new label while the request still decodes with its old adapter. No group, no pause: loading a
new adapter leaves every running request as it is.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from asyncrl.generator_http import GeneratorError, adapter_name
from asyncrl.recipe import LoraConfig
from asyncrl.weights.exports import peft_config, write_adapter_export
from asyncrl.weights.members import Member

log = logging.getLogger("asyncrl.weights")

PARTS = (".lora_A.weight", ".lora_B.weight")
KEEP = 2
"""Adapters an SGLang server keeps loaded: this version's and the one before (requests submitted
just before the label moved still name it)."""


def is_adapter(names: Iterable[str]) -> bool:
    """Whether a snapshot holds LoRA adapter tensors (the learner sends only them with LoRA on)."""
    names = list(names)
    return bool(names) and all(n.endswith(PARTS) for n in names)


async def load(m: Member, folder: Path, version: int) -> None:
    """Load ``folder`` on SGLang member ``m`` as ``v{version}`` and label it with the version.
    An adapter of that name left from before (a retried version) is replaced."""
    name = adapter_name(version)
    try:
        await m.client.load_lora_adapter(name, str(folder))
    except GeneratorError as e:
        if "already" not in e.message:
            raise
        await m.client.unload_lora_adapter(name)
        await m.client.load_lora_adapter(name, str(folder))
    await m.client.relabel(str(version))


async def unload_old(m: Member, version: int) -> None:
    """Let go of the adapter :data:`KEEP` versions back (best effort: SGLang answers once its
    requests are done; one it never loaded, after a rejoin, is no error worth more than a line)."""
    old = version - KEEP
    if old < 1:
        return
    try:
        await m.client.unload_lora_adapter(adapter_name(old))
    except GeneratorError as e:
        log.info("weights: %s: unloading adapter %s: %s", m.url, adapter_name(old), e.message)


class ByName:
    """Sends LoRA versions to the SGLang members (the built-in engines take the weight group's
    path). ``root``: where the versions' folders go; ``lora``: the recipe's ``learner.lora``."""

    def __init__(self, root: Path, lora: LoraConfig, fanout, timeout_s: float):
        self.root, self.lora, self.fanout, self.timeout_s = root, lora, fanout, timeout_s
        self.background = None  # a nursery for the unloads (the sender task's)

    @staticmethod
    def takes(m: Member, snap_names: Iterable[str]) -> bool:
        return m.info.kind != "builtin" and is_adapter(snap_names)

    async def send(self, snap, members: list[Member]) -> tuple[list[Member], dict[str, str]]:
        """Write the version's folder, load it on every member: (those that hold it now, url ->
        why each other one failed)."""
        tensors = dict(snap.named())
        folder = self.root / adapter_name(snap.version)
        config = peft_config(self.lora)
        await self.fanout.in_thread(
            lambda: write_adapter_export(tensors, folder, config=config, version=snap.version)
        )
        ok, bad = await self.fanout.each(
            members, lambda m: load(m, folder, snap.version), timeout=self.timeout_s + 5
        )
        loaded = [m for m in members if m.url in ok]
        # a folder is read again only by SGLang reloading an unloaded adapter a late request
        # names: kept one version longer than the adapter itself
        shutil.rmtree(self.root / adapter_name(snap.version - KEEP - 1), ignore_errors=True)
        if self.background is not None:
            for m in loaded:
                self.background.start_soon(unload_old, m, snap.version)
        return loaded, {u: f"load_lora_adapter: {e}" for u, e in bad.items()}
