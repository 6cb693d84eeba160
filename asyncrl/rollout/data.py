"""Prompts for rollouts: HuggingFace ``datasets`` from local jsonl/json/parquet, with a resumable
position (docs/design.md §6).

- A malformed row (not JSON, no prompt, a prompt that is neither text nor chat messages) is reported
  with its file and row number (1-based; the line number for jsonl) and skipped, never fatal.
- Prompts are rendered with the tokenizer's chat template when ``data.chat_template`` is on.
- The position is a counter over an endless, seeded, per-epoch shuffled order, plus the prompts handed
  out but not yet delivered (``outstanding``). :meth:`PromptSource.state_dict` goes into the learner's
  checkpoint (via the groups' metadata, see the worker); after a restart :meth:`load_state_dict`
  serves the outstanding prompts again first and then continues, so none is repeated or skipped.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class PromptDataError(ValueError):
    """The prompt data cannot be used at all (missing file, no usable rows); one line naming the file."""


@dataclass(kw_only=True)
class PromptItem:
    """One prompt handed to a group: its position (for the data state) and its dataset row."""

    index: int
    row: dict[str, Any]
    where: str  # "file:row N", for reports


def _valid_prompt(p: Any) -> str:
    """'' if ``p`` is a usable prompt, else why not."""
    if isinstance(p, str):
        return "" if p else "the prompt is empty"
    if isinstance(p, list) and p:
        for i, m in enumerate(p):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                return f"message {i} of the prompt is not {{role, content}}"
        return ""
    return f"the prompt is a {type(p).__name__}, expected text or a list of chat messages"


def load_prompt_rows(
    path: str | Path, *, prompt_key: str = "prompt"
) -> tuple[Any, list[int], list[str]]:
    """Read a data file into a ``datasets.Dataset`` of good rows.

    Returns (dataset, the file row number of each dataset row, reports of skipped rows).
    """
    import datasets

    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"{path}: data file not found")
    skipped: list[str] = []
    good: list[dict] = []
    numbers: list[int] = []

    def take(row: Any, n: int) -> None:
        if not isinstance(row, dict):
            skipped.append(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        elif prompt_key not in row or row[prompt_key] is None:
            skipped.append(f"{path}:{n}: no {prompt_key!r} field (data.prompt_key)")
        elif why := _valid_prompt(row[prompt_key]):
            skipped.append(f"{path}:{n}: {why}")
        else:
            good.append(row)
            numbers.append(n)

    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    skipped.append(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})")
                    continue
                take(row, n)
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(rows, list):
            raise PromptDataError(f"{path}: expected a JSON list of rows")
        for n, row in enumerate(rows, start=1):
            take(row, n)
    elif path.suffix == ".parquet":
        try:
            table = datasets.Dataset.from_parquet(str(path))
        except Exception as e:
            raise PromptDataError(
                f"{path}: cannot read parquet ({type(e).__name__}: {e})"
            ) from None
        for n, row in enumerate(table, start=1):
            take(row, n)
    else:
        raise PromptDataError(f"{path}: expected a .jsonl, .json or .parquet file")
    for s in skipped:
        log.warning("skipping a malformed row: %s", s)
    if not good:
        raise PromptDataError(f"{path}: no usable rows ({len(skipped)} malformed)")
    try:
        ds = datasets.Dataset.from_list(good)
    except Exception as e:  # e.g. a field that is a number in one row and text in another
        raise PromptDataError(
            f"{path}: rows do not share one schema ({type(e).__name__}: {e})"
        ) from None
    return ds, numbers, skipped


class PromptSource:
    """An endless, resumable stream of prompts from one dataset (or one shard of it)."""

    def __init__(
        self,
        rows: Any,
        *,
        name: str = "data",
        row_numbers: list[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        i, n = shard
        if not 0 <= i < n:
            raise ValueError(f"shard {i} of {n} does not exist")
        self.rows = rows
        self.name = name
        self.row_numbers = row_numbers or list(range(1, len(rows) + 1))
        self.shuffle, self.seed, self.shard = shuffle, seed, (i, n)
        self.mine = list(range(len(rows)))[i::n]
        if not self.mine:
            raise PromptDataError(f"{name}: {len(rows)} rows cannot fill shard {i} of {n}")
        self.next_index = 0
        self.outstanding: set[int] = set()
        self._retry: deque[int] = deque()
        self._epoch = -1
        self._order: list[int] = []
        self.skipped: list[str] = []

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        prompt_key: str = "prompt",
        shuffle: bool = True,
        seed: int = 0,
        shard: tuple[int, int] = (0, 1),
    ) -> PromptSource:
        ds, numbers, skipped = load_prompt_rows(path, prompt_key=prompt_key)
        src = cls(ds, name=str(path), row_numbers=numbers, shuffle=shuffle, seed=seed, shard=shard)
        src.skipped = skipped
        return src

    def __len__(self) -> int:
        return len(self.mine)

    def _row_at(self, index: int) -> int:
        epoch, pos = divmod(index, len(self.mine))
        if epoch != self._epoch:
            order = np.arange(len(self.mine))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.mine))
            self._epoch, self._order = epoch, order.tolist()
        return self.mine[self._order[pos]]

    def take(self) -> PromptItem:
        """The next prompt (outstanding ones from a restored state first)."""
        if self._retry:
            index = self._retry.popleft()
        else:
            index = self.next_index
            self.next_index += 1
        self.outstanding.add(index)
        r = self._row_at(index)
        return PromptItem(
            index=index, row=dict(self.rows[r]), where=f"{self.name}:{self.row_numbers[r]}"
        )

    def done(self, index: int) -> None:
        """The prompt at ``index`` needs no more rollouts (its group was delivered or dropped)."""
        self.outstanding.discard(index)

    def give_back(self, index: int) -> None:
        """The prompt at ``index`` was not delivered (its group failed or was cancelled): it is
        served again, before any new one."""
        self.outstanding.discard(index)
        self._retry.appendleft(index)

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_index": self.next_index,
            "outstanding": sorted(self.outstanding | set(self._retry)),
            "num_rows": len(self.rows),
            "shard": list(self.shard),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses a state made for another dataset or shard."""
        for key, mine in (
            ("num_rows", len(self.rows)),
            ("shard", list(self.shard)),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if state.get(key) != mine:
                raise PromptDataError(
                    f"{self.name}: saved data position has {key}={state.get(key)!r}, "
                    f"this data has {mine!r}: not the same data set or settings"
                )
        self.next_index = int(state["next_index"])
        self.outstanding = set()
        self._retry = deque(int(i) for i in state.get("outstanding", []))


def render_prompt(
    row: dict[str, Any],
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    chat_template: bool = False,
    tools: list[dict] | None = None,
) -> tuple[str, list[int]]:
    """A row's prompt as text and token ids (blocking: call it from a thread).

    With ``chat_template``, a text prompt becomes one user message; chat messages are used as given.
    """
    p = row[prompt_key]
    if chat_template:
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        return text, list(tokenizer.encode(text, add_special_tokens=False))
    if not isinstance(p, str):
        raise ValueError("the prompt is a list of chat messages: set data.chat_template: true")
    return p, list(tokenizer.encode(p, add_special_tokens=True))
