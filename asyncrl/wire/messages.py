"""Every message a process can send another, as dataclasses (docs/design.md §3).

The dataclasses are the schema: a field's type hint says how it is checked when a message arrives
(:mod:`asyncrl.wire.validate`), a default makes it optional, and an ``Annotated`` bound or token
array says what the plain type does not (the range of a count, the dtype of a per-token array).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, get_args

import numpy as np

SCHEMA_VERSION = 2

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Upper bound on one encoded message; transports refuse larger ones before reading them fully."""
MAX_TOKENS = 1 << 20
"""Upper bound on one sample's prompt or completion length."""
MAX_ITEMS = 1 << 16
"""Upper bound on the number of samples in a group, groups in a put, generators in a register..."""
MAX_STR = 1 << 16
"""Upper bound on one string field."""


class WireError(ValueError):
    """A message could not be encoded or decoded; the text says which field and why."""


@dataclass(frozen=True)
class Bounds:
    """The closed range an integer field must lie in (``Annotated[int, Bounds(lo, hi)]``)."""

    lo: int
    hi: int


@dataclass(frozen=True)
class TokenArray:
    """Marks a :class:`Sample` field as a per-token array: its little-endian dtype on the wire,
    whether it runs over the prompt's tokens or the completion's, and whether it may be absent
    (``optional``: empty, or one entry per token; a message's samples have it all or none)."""

    dtype: np.dtype
    over: Literal["prompt", "completion"]
    optional: bool = False


Count = Annotated[int, Bounds(0, MAX_ITEMS)]
PolicyVersion = Annotated[int, Bounds(0, 2**62)]
FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)

_PromptIds = Annotated[np.ndarray, TokenArray(np.dtype("<i4"), "prompt")]
_PerTokenInt32 = Annotated[np.ndarray, TokenArray(np.dtype("<i4"), "completion")]
_PerTokenFloat32 = Annotated[np.ndarray, TokenArray(np.dtype("<f4"), "completion")]
_OptionalFloat32 = Annotated[np.ndarray, TokenArray(np.dtype("<f4"), "completion", optional=True)]


def _no_tokens() -> np.ndarray:
    return np.zeros(0, np.float32)


ROUTE_DTYPES: tuple[np.dtype, ...] = (np.dtype("u1"), np.dtype("<i2"), np.dtype("<i4"))
"""The dtypes routed experts travel in, narrowest first (:func:`route_dtype`)."""


def route_dtype(num_experts: int) -> np.dtype:
    """The narrowest of :data:`ROUTE_DTYPES` that holds expert ids ``0..num_experts - 1``: one
    byte a position, layer and k up to 256 experts (Qwen3-MoE's 128, DeepSeek-V3's 256), where
    SGLang sends four."""
    if num_experts <= 1 << 8:
        return ROUTE_DTYPES[0]
    return ROUTE_DTYPES[1] if num_experts <= 1 << 15 else ROUTE_DTYPES[2]


def _no_routes() -> np.ndarray:
    return np.zeros((0, 0, 0), np.uint8)


@dataclass(kw_only=True)
class Sample:
    """One completion of one prompt. Per-token arrays all have ``len(completion_ids)`` entries
    (an optional one none, when it was not asked for)."""

    id: str
    group_id: str
    prompt_ids: _PromptIds
    completion_ids: _PerTokenInt32
    behavior_logprobs: _PerTokenFloat32  # from the generator
    versions: _PerTokenInt32  # the policy version that produced each token
    loss_mask: _PerTokenFloat32  # 0 on tokens the policy did not produce (tool output)
    reward: float = 0.0
    finish_reason: FinishReason = "stop"
    metadata: dict[str, Any] = field(default_factory=dict)
    # on-policy distillation: the teacher's log-probability of each completion token given the
    # prompt and the tokens before it (rollout.teacher; empty without one)
    teacher_logprobs: _OptionalFloat32 = field(default_factory=_no_tokens)
    # routing replay (algorithm.routing_replay): the experts the generator's router chose in every
    # MoE layer at every input position, the prompt and the completion but its last token (never
    # fed), ``[num_tokens - 1, moe_layers, top_k]`` in a :data:`ROUTE_DTYPES` dtype; empty without
    routed_experts: np.ndarray = field(default_factory=_no_routes)

    @property
    def behavior_version(self) -> int:
        """The oldest version among the policy's own tokens (docs/design.md §2)."""
        mask = self.loss_mask > 0
        if not mask.any():
            return int(self.versions.min()) if len(self.versions) else 0
        return int(self.versions[mask].min())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(kw_only=True)
class Group:
    """The n samples of one prompt: GRPO's unit, and the unit the buffer stores and hands out."""

    kind: ClassVar[str] = "group"
    id: str
    lease_id: str = ""
    samples: Sequence[Sample]  # a list, or a decoded group's SampleList (asyncrl.wire.columns)
    prompt_index: int = -1  # position in the dataset, for the resumable data position
    # the worker's prompt-source state as if this group were delivered ({}: none); the buffer keeps
    # each worker's newest so a restarted worker neither repeats nor skips prompts
    data_state: dict[str, Any] = field(default_factory=dict)
    # ReMax's baseline: the reward of the prompt's greedy completion, scored but not trained on
    # (None: no greedy episode, or it failed; the learner then uses the group's mean reward)
    baseline_reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def behavior_version(self) -> int:
        return min(s.behavior_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        """Each sample's reward; a decoded group reads them from its column, building no sample."""
        column = getattr(self.samples, "rewards", None)
        if column is not None:
            return column
        return [s.reward for s in self.samples]


@dataclass(kw_only=True)
class Acquire:
    """A worker asks for a lease on up to ``starts`` group starts."""

    kind: ClassVar[str] = "acquire"
    worker_id: str
    starts: Count
    request_id: str = ""


@dataclass(kw_only=True)
class Grant:
    """A lease: ``starts`` groups may be started under ``lease_id`` until ``lease_seconds`` pass
    (``starts`` may be 0: at the bound, ask again later)."""

    kind: ClassVar[str] = "grant"
    lease_id: str
    starts: Count
    version: PolicyVersion
    lease_seconds: float
    request_id: str = ""


@dataclass(kw_only=True)
class Put:
    """Whole groups for the buffer; several per message to amortise per-message overhead."""

    kind: ClassVar[str] = "put"
    worker_id: str
    groups: list[Group]


@dataclass(kw_only=True)
class Ack:
    """Groups now stored (or already stored: duplicates are acknowledged and ignored)."""

    kind: ClassVar[str] = "ack"
    group_ids: list[str]
    rejected: dict[str, str] = field(default_factory=dict)  # group id -> reason
    version: PolicyVersion = 0


@dataclass(kw_only=True)
class Release:
    """A worker gives back ``starts`` unused starts of a lease (a cancelled or never-started group)."""

    kind: ClassVar[str] = "release"
    worker_id: str
    lease_id: str
    starts: Count


@dataclass(kw_only=True)
class GeneratorInfo:
    """One generator a worker drives, as the weight broadcaster needs to reach it."""

    url: str
    # ranks it takes in the weight group when it has no /server_info (else tp_size)
    world_size: Annotated[int, Bounds(1, 4096)] = 1
    kind: str = "sglang"  # sglang | builtin


@dataclass(kw_only=True)
class Register:
    """A worker tells the learner which generators it drives, so they receive weights."""

    kind: ClassVar[str] = "register"
    worker_id: str
    generators: list[GeneratorInfo]
    # The worker process has just started and holds no lease: any lease still open under this
    # worker id is a dead process's, and its starts return now instead of after lease_seconds.
    fresh: bool = False


@dataclass(kw_only=True)
class Ok:
    kind: ClassVar[str] = "ok"
    version: PolicyVersion = 0
    message: str = ""


@dataclass(kw_only=True)
class Error:
    """The reply to a message the service could not take; ``code`` is machine-readable."""

    kind: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(kw_only=True)
class Status:
    """Ask the service for its counters (for tools, tests and the launcher's progress bar)."""

    kind: ClassVar[str] = "status"


@dataclass(kw_only=True)
class StatusReply:
    kind: ClassVar[str] = "status_reply"
    version: PolicyVersion
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Version:
    """Published on every new policy version; ``checkpoint`` is an HF folder to load from disk."""

    kind: ClassVar[str] = "version"
    version: PolicyVersion
    checkpoint: str = ""
    max_staleness: Annotated[int, Bounds(0, 2**31)] = 0


@dataclass(kw_only=True)
class End:
    """Published when the learner has trained its last version: the run is over, workers stop.

    A learner that dies sends none, so a worker that hears no version keeps waiting for a restarted
    learner; only this message (or a ``run_ended`` error reply) tells it to leave."""

    kind: ClassVar[str] = "end"
    version: PolicyVersion
    message: str = ""


Message = (
    Group
    | Acquire
    | Grant
    | Put
    | Ack
    | Release
    | Register
    | Ok
    | Error
    | Status
    | StatusReply
    | Version
    | End
)

MESSAGES: dict[str, type] = {m.kind: m for m in get_args(Message)}
"""Every message class by its ``kind``."""
