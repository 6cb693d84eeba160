"""The learner's batch sources over a local data set: sft's (prompt, completion) rows and, for a
reward model, (prompt, chosen, rejected) pairs (:class:`PreferenceSource`), from a local file,
tokenized with the model's tokenizer.

It is a :class:`~asyncrl.learner.source.BatchSource`, as the RL buffer is: each row
becomes a group of one sample whose completion is the target (``loss_mask`` 1, plus EOS), so sft runs
through the same learner step with ``algorithm.loss: sft``. The data position (epoch, cursor) is part
of the checkpoint, and each epoch's order is a pure function of (seed, epoch): a resumed run sees
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Self

import numpy as np

from asyncrl import tasks, wire
from asyncrl.buffer.store import Batch
from asyncrl.learner.source import BatchSource
from asyncrl.recipe import DataConfig, Recipe


class DataError(ValueError):
    """A data file or row the sft source cannot use (one-line message naming the file and row)."""


def load_rows(path: str | Path, fields: dict[str, str]) -> list[dict[str, str]]:
    """Rows of a jsonl/json/parquet file as ``{name: str(row[key])}`` for ``fields`` {name: key},
    checked to have every key (the error names the file, the row and the missing field)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import datasets

        raw: Any = datasets.load_dataset("parquet", data_files=str(path), split="train")
    else:
        raw = tasks.read_jsonl(path)
    rows = []
    for i, r in enumerate(raw):
        missing = [k for k in fields.values() if k not in r]
        if missing:
            raise DataError(f"{path}: row {i + 1} has no {missing[0]!r} field")
        rows.append({name: str(r[key]) for name, key in fields.items()})
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_sft_rows(
    path: str | Path, *, prompt_key: str, completion_key: str
) -> list[dict[str, str]]:
    """Rows ``{prompt, completion}`` of a jsonl/json/parquet file, checked to have both keys."""
    return load_rows(path, {"prompt": prompt_key, "completion": completion_key})


class SFTSource(BatchSource):
    """Batches of ``batch_size`` rows, shuffled per epoch; a resumable position."""

    def __init__(
        self,
        rows: list[dict[str, str]],
        tokenizer: Any,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        chat_template: bool = False,
        max_len: int = 0,
    ) -> None:
        self.rows, self.tok = rows, tokenizer
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.chat_template, self.max_len = chat_template, max_len
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise DataError("the model's tokenizer has no eos_token: sft targets need one")
        self.epoch, self.cursor, self.version = 0, 0, 0
        self._order = self._permutation(0)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> SFTSource:
        d = recipe.data
        if d.task:
            n = d.num_examples or 10_000
            rows = [
                {"prompt": r["prompt"], "completion": r["completion"]}
                for r in tasks.examples(d.task, split="train", n=n, seed=recipe.run.seed)
            ]
        elif d.path:
            rows = load_sft_rows(
                recipe.resolve(d.path), prompt_key=d.prompt_key, completion_key=d.completion_key
            )
        else:
            raise DataError("data.path (or data.task) is required for sft")
        return cls.from_rows(recipe, rows)

    @classmethod
    def from_rows(cls, recipe: Recipe, rows: list[dict[str, str]]) -> Self:
        """A source of ``rows`` with the recipe's tokenizer, batch size, order and length."""
        from transformers import AutoTokenizer

        d = recipe.data
        return cls(
            rows,
            AutoTokenizer.from_pretrained(str(recipe.resolve(recipe.model.path))),
            batch_size=recipe.learner.batch_size,
            shuffle=d.shuffle,
            seed=recipe.run.seed,
            chat_template=d.chat_template,
            max_len=recipe.model.max_seq_len,
        )

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"sft:{self.seed}:{epoch}").shuffle(order)
        return order

    def tokenize(self, row: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
        if self.chat_template:
            msgs = [{"role": "user", "content": row["prompt"]}]
            prompt = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(prompt, dict):
                prompt = prompt["input_ids"]
        else:
            prompt = self.tok(row["prompt"])["input_ids"]
        completion = self.tok(row["completion"], add_special_tokens=False)["input_ids"] + [self.eos]
        return np.asarray(prompt, np.int32), np.asarray(completion, np.int32)

    # BatchSource ---------------------------------------------------------------------------------

    def next_batch(self, timeout_s: float = 0.0) -> Batch:
        groups = []
        for _ in range(self.batch_size):
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            i = self._order[self.cursor]
            self.cursor += 1
            p, c = self.tokenize(self.rows[i])
            sample = wire.Sample(
                id=f"sft-{self.epoch}-{i}",
                group_id=f"sft-{self.epoch}-{i}",
                prompt_ids=p,
                completion_ids=c,
                behavior_logprobs=np.zeros(len(c), np.float32),
                versions=np.full(len(c), self.version, np.int32),
                loss_mask=np.ones(len(c), np.float32),
            )
            groups.append(wire.Group(id=sample.group_id, samples=[sample], prompt_index=i))
        return Batch(groups=groups, version=self.version, stats={"data/epoch": self.epoch})

    def set_version(self, v: int, checkpoint: str = "") -> None:
        self.version = v

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "version": self.version}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.cursor = int(d["epoch"]), int(d["cursor"])
        self.version = int(d.get("version", 0))
        self._order = self._permutation(self.epoch)


class PreferenceSource(SFTSource):
    """``reward_model`` batches: each row ``{prompt, chosen, rejected}`` becomes a group of two
    samples, chosen first, each completion ending in EOS (as a policy's finished completion does,
    so the reward model scores what it will be served). Same order, position and resume as sft."""

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> PreferenceSource:
        d = recipe.data
        if not d.path:
            raise DataError("data.path (a jsonl or parquet file of preference pairs) is required")
        rows = load_preference_rows(recipe.resolve(d.path), d)
        return cls.from_rows(recipe, rows)

    def pair(self, row: dict[str, str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt, chosen, rejected) token ids."""
        p, c = self.tokenize({"prompt": row["prompt"], "completion": row["chosen"]})
        _, r = self.tokenize({"prompt": row["prompt"], "completion": row["rejected"]})
        return p, c, r

    def next_batch(self, timeout_s: float = 0.0) -> Batch:
        groups = []
        for _ in range(self.batch_size):
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            i = self._order[self.cursor]
            self.cursor += 1
            p, c, r = self.pair(self.rows[i])
            gid = f"rm-{self.epoch}-{i}"
            samples = [
                wire.Sample(
                    id=f"{gid}/{side}",
                    group_id=gid,
                    prompt_ids=p,
                    completion_ids=ids,
                    behavior_logprobs=np.zeros(len(ids), np.float32),
                    versions=np.full(len(ids), self.version, np.int32),
                    loss_mask=np.ones(len(ids), np.float32),
                    reward=reward,
                )
                for side, ids, reward in (("chosen", c, 1.0), ("rejected", r, 0.0))
            ]
            groups.append(wire.Group(id=gid, samples=samples, prompt_index=i))
        return Batch(groups=groups, version=self.version, stats={"data/epoch": self.epoch})


def load_preference_rows(path: str | Path, d: DataConfig) -> list[dict[str, str]]:
    """``{prompt, chosen, rejected}`` rows of a preference file, named by the recipe's data keys."""
    return load_rows(
        path, {"prompt": d.prompt_key, "chosen": d.chosen_key, "rejected": d.rejected_key}
    )
