"""The :class:`Recipe`: its sections, and the ones every process reads (``run``, ``model``,
``data``, ``logging``). The sections a single side reads are in rollout_sections.py,
learner_sections.py and exchange_sections.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncrl.recipe.exchange_sections import BufferConfig, WeightsConfig
from asyncrl.recipe.fields import Dtype, setting
from asyncrl.recipe.learner_sections import (
    AlgorithmConfig,
    CriticConfig,
    LearnerConfig,
    PlacementConfig,
)
from asyncrl.recipe.rollout_sections import GeneratorConfig, RolloutConfig


@dataclass(kw_only=True)
class RunConfig:
    name: str = setting("run", doc="run folder name under output_dir")
    output_dir: str = setting("runs")
    seed: int = setting(0, lo=0)
    steps: int = setting(100, lo=0, doc="optimizer steps (policy versions) to train")
    resume: bool = setting(False, doc="continue from the run folder's latest checkpoint")
    eval_every: int = setting(
        0, lo=0, doc="evaluate held-out prompts every k versions (0: start/end only)"
    )
    eval_prompts: int = setting(128, lo=0)
    timeout_s: float = setting(3600.0, lo=0, lo_open=True, doc="whole-run wall clock bound")
    max_restarts: int = setting(
        3,
        lo=0,
        doc="`asyncrl run` restarts a child that dies this many times (the learner from its "
        "last checkpoint); 0: the first death ends the run",
    )


@dataclass(kw_only=True)
class ModelConfig:
    path: str = setting("", doc="HuggingFace model folder: config.json, safetensors, tokenizer")
    dtype: Dtype = setting("float32")
    attention: Literal["auto", "sdpa", "flex", "varlen"] = setting("auto")
    max_seq_len: int = setting(4096, lo=1)


@dataclass(kw_only=True)
class DataConfig:
    path: str = setting("", doc="jsonl or parquet file of training prompts")
    eval_path: str = setting("", doc="held-out prompts (same format)")
    prompt_key: str = setting("prompt")
    answer_key: str = setting("answer")
    completion_key: str = setting("completion", doc="target text, for sft")
    chosen_key: str = setting("chosen", doc="reward_model: the preferred completion of a pair")
    rejected_key: str = setting("rejected", doc="reward_model: the other completion of the pair")
    chat_template: bool = setting(False, doc="wrap prompts with the tokenizer's chat template")
    shuffle: bool = setting(True)
    task: str = setting("", doc="built-in synthetic task name, instead of a file")
    num_examples: int = setting(0, lo=0, doc="size of a generated synthetic data set")


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: bool = setting(True)
    wandb_mode: Literal["offline", "online", "disabled"] = setting("offline")
    project: str = setting("asyncrl")
    group: str = setting("", doc="W&B run group (default: the run name)")
    every: int = setting(1, lo=1)
    progress: bool = setting(True)


@dataclass(kw_only=True)
class Recipe:
    run: RunConfig = setting(factory=RunConfig)
    model: ModelConfig = setting(factory=ModelConfig)
    data: DataConfig = setting(factory=DataConfig)
    rollout: RolloutConfig = setting(factory=RolloutConfig)
    generator: GeneratorConfig = setting(factory=GeneratorConfig)
    buffer: BufferConfig = setting(factory=BufferConfig)
    algorithm: AlgorithmConfig = setting(factory=AlgorithmConfig)
    learner: LearnerConfig = setting(factory=LearnerConfig)
    critic: CriticConfig = setting(factory=CriticConfig)
    placement: PlacementConfig = setting(factory=PlacementConfig)
    weights: WeightsConfig = setting(factory=WeightsConfig)
    logging: LoggingConfig = setting(factory=LoggingConfig)
    base_dir: str = field(default=".", metadata={"internal": True})
    """The recipe file's folder: relative paths in the recipe are resolved against it."""

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def resolve(self, path: str) -> Path:
        """A path from the recipe, relative to the recipe file's folder."""
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else Path(self.base_dir) / p

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("base_dir")
        return d
