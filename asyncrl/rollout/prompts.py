"""Prompts for rollouts: rows of a local jsonl/json/parquet file, as HuggingFace ``datasets`` holds
them, with a resumable position (docs/design.md §6).

- A malformed row (not JSON, no prompt, a prompt that is neither text nor chat messages) is reported
  with its file and row number (1-based; the line number for jsonl) and skipped, never fatal.
- Prompts are rendered with the tokenizer's chat template when ``data.chat_template`` is on.
- The position is a counter over an endless, seeded, per-epoch shuffled order, plus the prompts handed
  out but not yet delivered (``outstanding``). :meth:`PromptSource.state_dict` goes into the learner's
  checkpoint (via the groups' metadata, see the worker); after a restart :meth:`load_state_dict`
  serves the outstanding prompts again first and then continues, so none is repeated or skipped.
"""

from __future__ import annotations

import copy
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


class _Unsure(Exception):
    """A value whose round trip through an Arrow table :func:`_plain_rows` does not vouch for."""


_INT64 = range(-(2**63), 2**63)


def _shape(v: Any) -> Any:
    """What Arrow infers a JSON value's column type from: None (null: fits any type), the scalar
    type, ``("list", element shape)`` or ``("dict", keys in order, value shapes)``. Raises
    :class:`_Unsure` for what Arrow may change or refuse (an int outside int64, an empty dict, an
    empty key, text it cannot encode, a list whose elements differ)."""
    if v is None:
        return None
    if isinstance(v, str):
        if not v.isascii():
            try:
                v.encode()
            except UnicodeEncodeError:  # a lone surrogate ("\\ud800" in the JSON): Arrow refuses it
                raise _Unsure from None
        return str
    if isinstance(v, bool | float):
        return type(v)
    if isinstance(v, int):
        if v not in _INT64:
            raise _Unsure
        return int
    if isinstance(v, list):
        s = None
        for x in v:
            s = _merge(s, _shape(x))
        return ("list", s)
    if isinstance(v, dict) and v:
        return ("dict", tuple(map(_key, v)), tuple(_shape(x) for x in v.values()))
    raise _Unsure


def _key(k: str) -> str:
    if _shape(k) is not str or not k:
        raise _Unsure
    return k


def _merge(a: Any, b: Any) -> Any:
    """One shape for two values that Arrow stores in one column unchanged (nulls fit any)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "list":
        return ("list", _merge(a[1], b[1]))
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:2] == b[:2]:  # dicts, the same keys
        return (*a[:2], tuple(_merge(x, y) for x, y in zip(a[2], b[2], strict=True)))
    raise _Unsure


def _plain_rows(rows: list[dict]) -> list[dict] | None:
    """``rows`` themselves when ``datasets.Dataset.from_list(rows)`` would give every row back as it
    is, else None.

    It would when all rows have one shape (:func:`_shape`: the same keys in the same order at every
    level, one type per field, nulls anywhere): Arrow then infers no type that changes a value (no
    int widened to float, no key added as null or dropped, no keys reordered). jsonl prompts almost
    always are such rows, and reading them without ``datasets`` saves its import, with pandas,
    pyarrow and aiohttp (0.8–1.1 s of a rollout worker's start, BENCHMARKS.md sessions 13 and 17);
    any other rows go through ``datasets`` as before, with the error it raises for rows of no one
    schema.
    """
    try:
        s = None
        for row in rows:
            if not isinstance(row, dict):
                return None
            s = _merge(s, _shape(row))
    except _Unsure:
        return None
    return rows


def load_prompt_rows(
    path: str | Path, *, prompt_key: str = "prompt"
) -> tuple[Any, list[int], list[str]]:
    """Read a data file's good rows: a list of dicts, or a ``datasets.Dataset`` where Arrow's
    schema changes rows (:func:`_plain_rows`); either gives the same row dicts.

    Returns (rows, the file row number of each row, reports of skipped rows). ``datasets`` is
    imported only for parquet and for rows of mixed shapes.
    """
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
        import datasets

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
    plain = _plain_rows(good)
    if plain is not None:
        return plain, numbers, skipped
    import datasets

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
        # a copy to the last level, as a Dataset's row is: a workflow that changes its row (or
        # its messages) changes no later epoch's
        return PromptItem(
            index=index,
            row=copy.deepcopy(dict(self.rows[r])),
            where=f"{self.name}:{self.row_numbers[r]}",
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
