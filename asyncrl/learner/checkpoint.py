"""The learner's DCP checkpoints through TorchTitan's ``CheckpointManager``: the actor's model,
optimizer and LR schedule, the critic's as extra states, and the learner's own state (version and
the batch source's position) as one JSON string. At a fresh start the same manager loads the HF
weights of ``model.path`` (when every rank holds the actor).

Collective over every rank: a rank saves and loads the states of the roles it holds (DCP writes the
union, each rank reads its own keys); a role held elsewhere is an :class:`_Absent` placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import MODEL, CheckpointManager, ModelWrapper

from asyncrl.learner.lora import is_adapter
from asyncrl.recipe import LearnerConfig


class _Absent(Stateful):
    """A state of a role this rank does not hold (placement): nothing to save, nothing to load."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class _LearnerState(Stateful):
    """The learner's own part of a checkpoint, as JSON text.

    One string leaf (not nested dicts) so that DCP can load it into a placeholder of any shape.
    """

    def __init__(self) -> None:
        self.text = "{}"

    def state_dict(self) -> dict[str, Any]:
        return {"json": self.text}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.text = state_dict["json"]


class _Adapters(ModelWrapper):
    """The actor's part of a LoRA run's checkpoint: its adapters only. The frozen base is not
    saved; a resume reads it from ``model.path`` again."""

    def _get_state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super()._get_state_dict().items() if is_adapter(k)}


class Checkpoints:
    """One run's checkpoint folder (``run_dir/checkpoints/step-N``). ``None`` for a model, optimizer,
    schedule or extra state this rank does not hold. ``hf_folder``: the HF weights a fresh start
    loads through the manager (None: the caller loads them itself, on the actor's ranks, as the
    adapter wants every key). With ``enabled`` False nothing is written (the HF load still runs).
    ``adapters_only``: the model's state is its LoRA adapters (:class:`_Adapters`)."""

    def __init__(
        self,
        learner: LearnerConfig,
        *,
        model: torch.nn.Module | None,
        optimizers: Any,
        lr_schedulers: Any,
        extra_states: dict[str, Stateful | None],
        adapter: Any,
        run_dir: Path,
        hf_folder: Path | None,
        enabled: bool,
        adapters_only: bool = False,
    ) -> None:
        self.enabled = enabled
        self._state = _LearnerState()
        keep = learner.keep_checkpoints
        extra = {k: v if v is not None else _Absent() for k, v in extra_states.items()}
        self.manager = CheckpointManager.Config(
            enable=True,
            folder="checkpoints",
            interval=learner.checkpoint_every or (1 << 40),
            keep_latest_k=0 if keep == 0 else max(keep, 2),
            initial_load_path=str(hf_folder.resolve()) if hf_folder is not None else None,
            initial_load_in_hf=hf_folder is not None,
            initial_load_model_only=True,
            last_save_model_only=False,
            async_mode="async" if learner.checkpoint_async else "disabled",
            load_only=not enabled,
        ).build(
            dataloader=None,
            model_parts=[model] if model is not None else [],
            optimizers=optimizers if optimizers is not None else _Absent(),
            lr_schedulers=lr_schedulers if lr_schedulers is not None else _Absent(),
            states={"learner": self._state, **extra},
            sd_adapter=adapter,
            base_folder=str(run_dir) if enabled else str(run_dir / ".no-ckpt"),
        )
        if adapters_only:
            self.manager.states[MODEL] = _Adapters([model] if model is not None else [])

    @property
    def folder(self) -> Path:
        return Path(self.manager.folder)

    def latest_step(self) -> int:
        """The highest complete ``step-N`` in the folder, or -1."""
        return self.manager._find_load_step() if self.enabled else -1

    def load(self) -> dict[str, Any] | None:
        """The latest ``step-N`` into the states, and the learner's state saved with it; at a fresh
        start the HF weights (``hf_folder``) and None."""
        step = self.latest_step()
        self.manager.load()
        return json.loads(self._state.text) if step >= 0 else None

    def due(self, version: int, *, force: bool = False) -> bool:
        """Whether :meth:`save` at ``version`` writes (every ``learner.checkpoint_every``, or forced)."""
        return self.enabled and (force or self.manager._should_save(version))

    def save(self, version: int, learner_state: str, *, last: bool = False) -> bool:
        """Save ``step-{version}`` with ``learner_state`` (JSON text, the same on every rank)."""
        self._state.text = learner_state
        return self.manager.save(curr_step=version, last_step=last)

    def wait(self) -> None:
        """Until an asynchronous save in flight is on disk."""
        self.manager.maybe_wait_for_saving()

    def close(self) -> None:
        self.manager.maybe_wait_for_saving()
        self.manager.close()
