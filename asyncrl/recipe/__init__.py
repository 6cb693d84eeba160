"""The recipe: one typed schema for everything a user can set, loaded from YAML with dotted overrides.

Every field a process reads lives here. Validation errors name the file, the dotted key and what was
expected (with a "did you mean" for misspelt keys), and are raised as :class:`RecipeError` so that the
CLI can print one line and exit 2 instead of a traceback.

The package, by what each file holds (its docstring says why it is one):

- fields.py: the choices' ``Literal`` types, :func:`~asyncrl.recipe.fields.setting` (a field's doc
  and range) and :class:`RecipeError`;
- schema.py: :class:`Recipe` and the sections every process reads (run, model, data, logging);
  rollout_sections.py, learner_sections.py, exchange_sections.py: the sections one side reads (the
  workers; the learner; buffer and weights, between them);
- loader.py: :func:`load`, :func:`from_dict`, dotted overrides, :func:`dump`;
- checks.py: :func:`validate` as a list of named checks (:data:`~asyncrl.recipe.checks.CHECKS`),
  :func:`warnings`; served.py: the reward model's and the teacher's checks;
- layout.py: the rules a learner's placement obeys (asyncrl/learner/placement.py builds it).

Every name is imported from here: ``from asyncrl.recipe import Recipe, load``.
"""

from asyncrl.recipe.checks import CHECKS, check_lora, validate, warnings
from asyncrl.recipe.exchange_sections import BufferConfig, TLSConfig, WeightsConfig
from asyncrl.recipe.fields import (
    OFFLINE_LOSSES,
    TOKEN_ADVANTAGES,
    Advantage,
    Aggregation,
    Checkpointing,
    Dtype,
    EngineDevice,
    GeneratorKind,
    Loss,
    PauseMode,
    RecipeError,
    RewardInput,
    RewardNorm,
)
from asyncrl.recipe.layout import (
    check_critic_placement,
    check_placement,
    learner_roles,
    ref_is_lora_base,
)
from asyncrl.recipe.learner_sections import (
    ROLES,
    AlgorithmConfig,
    CriticConfig,
    LearnerConfig,
    LoraConfig,
    LoraTarget,
    PlacementConfig,
    RolePlacement,
)
from asyncrl.recipe.loader import dump, from_dict, load, parse_override
from asyncrl.recipe.rollout_sections import (
    GeneratorConfig,
    RewardModelConfig,
    RolloutConfig,
    TeacherConfig,
)
from asyncrl.recipe.schema import DataConfig, LoggingConfig, ModelConfig, Recipe, RunConfig
from asyncrl.recipe.served import TOKENIZER_FILES, tokenizer_difference

__all__ = [
    "CHECKS",
    "OFFLINE_LOSSES",
    "ROLES",
    "TOKENIZER_FILES",
    "TOKEN_ADVANTAGES",
    "Advantage",
    "Aggregation",
    "AlgorithmConfig",
    "BufferConfig",
    "Checkpointing",
    "CriticConfig",
    "DataConfig",
    "Dtype",
    "EngineDevice",
    "GeneratorConfig",
    "GeneratorKind",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "LoraTarget",
    "Loss",
    "ModelConfig",
    "PauseMode",
    "PlacementConfig",
    "Recipe",
    "RecipeError",
    "RewardInput",
    "RewardModelConfig",
    "RewardNorm",
    "RolePlacement",
    "RolloutConfig",
    "RunConfig",
    "TLSConfig",
    "TeacherConfig",
    "WeightsConfig",
    "check_critic_placement",
    "check_lora",
    "check_placement",
    "dump",
    "from_dict",
    "learner_roles",
    "load",
    "parse_override",
    "ref_is_lora_base",
    "tokenizer_difference",
    "validate",
    "warnings",
]
