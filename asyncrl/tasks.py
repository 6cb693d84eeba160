"""Synthetic tasks with exact-match rewards: the CPU demo's data, and the tests'.

Each task makes ``(prompt, answer)`` pairs from a seeded RNG, plus an SFT target (``completion``) that
may differ from the answer on purpose: for ``sort``, a pure-sorting SFT model samples almost never right
at temperature 1 and RL then has no signal, while a *noisy* target (mostly "copy the input", sometimes
"sort it") teaches both behaviours and leaves RL to choose (the demo: README, BENCHMARKS.md).

The held-out split is disjoint from training by construction: a prompt is held out iff a hash of the
prompt text falls in the held-out bucket, so no seed or size can leak a held-out prompt into training.

    python -m asyncrl.tasks sort OUT_DIR --train 20000 --eval 500 --seed 0

writes ``OUT_DIR/train.jsonl`` and ``OUT_DIR/eval.jsonl`` with keys ``prompt``, ``answer``,
``completion``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "eval"]
HELD_OUT_BUCKETS = 8
"""One prompt in HELD_OUT_BUCKETS (by hash) is held out: enough for 500 eval prompts of 2-digit addition."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """A family of prompts with one right answer each."""

    name: str
    make: Callable[[random.Random], tuple[str, str]]
    """One (prompt, answer) pair from the RNG."""
    sft_target: Callable[[random.Random, str, str], str]
    """The SFT completion for (prompt, answer): the answer itself, or a noisy target."""
    doc: str


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


def _letters(rng: random.Random) -> str:
    return "".join(rng.sample(string.ascii_lowercase, rng.randint(4, 5)))


def _sort(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"{s}=", "".join(sorted(s))


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"{s}=", s[::-1]


def _answer(rng: random.Random, prompt: str, answer: str) -> str:
    return answer


# -- lookup: the agent demo's task (asyncrl/agents/demo_agent.py serves the table over MCP) -------

LOOKUP_TOOL = "lookup"
LOOKUP_KEY_LETTERS = 3
"""Keys of 3 letters: 17,576 keys, ~2,200 of them held out (enough for 500 distinct eval prompts)."""
LOOKUP_TOOL_FRACTION = {"a-h": 0.9, "i-z": 0.3}
"""Share of lookup SFT transcripts that call the tool, by the key's first letter; the others answer
without it, ``=000`` (a placeholder: random guesses there drown the few copy examples, and a tiny
model then never learns to copy the tool's result). The warm start thus calls the tool under greedy
decoding for keys a-h only, and often when sampling for the rest: RL has to learn to call it for
every key."""
LOOKUP_NO_ANSWER = "000"


def lookup_value(key: str) -> str:
    """The table's value for ``key``: 3 digits from a hash, so no model can know it without asking."""
    h = int.from_bytes(hashlib.sha256(f"asyncrl-lookup:{key}".encode()).digest()[:8], "little")
    return f"{h % 1000:03d}"


def lookup_call(key: str) -> str:
    """The tool call a lookup transcript makes, in the multi-turn workflow's tagged format."""
    body = {"name": LOOKUP_TOOL, "arguments": {"key": key}}
    return f"<tool>{json.dumps(body, separators=(',', ':'))}</tool>"


def lookup_result(value: str) -> str:
    """The tool result as the multi-turn workflow shows it (workflows.tagged_result)."""
    return f"\n<result>{value}</result>\n"


def final_answer(completion: str) -> str:
    """The text after the last tool result (the whole completion if there is none), stripped: what
    a multi-turn episode answers."""
    return completion.rpartition("</result>")[2].strip()


def _lookup(rng: random.Random) -> tuple[str, str]:
    key = "".join(rng.choice(string.ascii_lowercase) for _ in range(LOOKUP_KEY_LETTERS))
    return f"{key}?", lookup_value(key)


def _lookup_transcript(rng: random.Random, prompt: str, answer: str) -> str:
    """Call the tool and answer with its result, or answer without it (LOOKUP_TOOL_FRACTION)."""
    key = prompt.rstrip("?")
    p = LOOKUP_TOOL_FRACTION["a-h" if key[0] <= "h" else "i-z"]
    if rng.random() < p:
        return lookup_call(key) + lookup_result(answer) + f"={answer}"
    return f"={LOOKUP_NO_ANSWER}"


SORT_COPY_FRACTION = 0.6
"""Share of sort SFT targets that copy the input instead of sorting it (the measured recipe)."""


def _noisy_sort(rng: random.Random, prompt: str, answer: str) -> str:
    return prompt.rstrip("=") if rng.random() < SORT_COPY_FRACTION else answer


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            name="addition",
            make=_addition,
            sft_target=_answer,
            doc="two 2-digit numbers: '37+45=' -> '82'",
        ),
        Task(
            name="sort",
            make=_sort,
            sft_target=_noisy_sort,
            doc="sort 4-5 distinct letters: 'dcab=' -> 'abcd' (noisy SFT target: 60% copy)",
        ),
        Task(
            name="reverse",
            make=_reverse,
            sft_target=_answer,
            doc="reverse 4-5 distinct letters: 'dcab=' -> 'bacd'",
        ),
        Task(
            name="lookup",
            make=_lookup,
            sft_target=_lookup_transcript,
            doc="a 3-letter key's value in a table only the 'lookup' tool knows: 'kqz?' -> '583', "
            "answered '=583' after the tool's result (SFT: the tool called for 90% of keys a-h, "
            "30% of the others; '=000' otherwise)",
        ),
    )
}


def get(name: str) -> Task:
    """The task called ``name``; a one-line error naming the choices otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}: expected one of {', '.join(TASKS)}") from None


def split_of(prompt: str) -> Split:
    """Which split a prompt belongs to: a pure function of the prompt text."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return "eval" if h % HELD_OUT_BUCKETS == 0 else "train"


def examples(name: str, *, split: Split, n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` rows ``{prompt, answer, completion}`` of ``split``, the same for the same arguments.

    Training rows may repeat a prompt (sampling with replacement, as fresh examples per step do);
    held-out rows are distinct prompts. Raises ValueError if the split has fewer than ``n`` prompts.
    """
    task = get(name)
    rng = random.Random(f"{name}:{split}:{seed}")
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise ValueError(f"task {name!r} has fewer than {n} distinct {split} prompts")
        prompt, answer = task.make(rng)
        if split_of(prompt) != split or (split == "eval" and prompt in seen):
            continue
        seen.add(prompt)
        rows.append(
            {"prompt": prompt, "answer": answer, "completion": task.sft_target(rng, prompt, answer)}
        )
    return rows


def score(completion: str, answer: str) -> float:
    """Exact match after stripping surrounding whitespace: 1.0 or 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def write_jsonl(path: str | Path, rows: list[dict[str, str]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_task(
    name: str, out_dir: str | Path, *, train: int, eval: int, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` for a task; returns their paths."""
    out = Path(out_dir)
    return (
        write_jsonl(out / "train.jsonl", examples(name, split="train", n=train, seed=seed)),
        write_jsonl(out / "eval.jsonl", examples(name, split="eval", n=eval, seed=seed)),
    )


def wrong_answer(rng: random.Random, answer: str) -> str:
    """A near miss of ``answer``: its characters shuffled (the letters of a sort or reverse task out
    of order, the digits of a sum swapped), else one character changed. Never ``answer``."""
    chars = list(answer)
    for _ in range(20):
        rng.shuffle(chars)
        if "".join(chars) != answer:
            return "".join(chars)
    i = rng.randrange(len(answer)) if answer else 0
    pool = string.digits if answer[i : i + 1].isdigit() else string.ascii_lowercase
    c = rng.choice([x for x in pool if x != answer[i : i + 1]])
    return answer[:i] + c + answer[i + 1 :]


def edited_answer(rng: random.Random, answer: str) -> str:
    """A wrong answer of the right form: 1 to ``len(answer)`` edits of ``answer`` (a character
    dropped, repeated, or replaced by one the answer does not have; near and far misses alike),
    never ``answer``. An answer in sorted order stays sorted, so a reward model must check which
    characters it has, not only their order: a policy optimising a model trained on shuffles alone
    learns sorted strings of the wrong letters (measured on the RLHF demo: held-out exact match
    0.17 -> 0.0 as the score rose), and one trained on one or two edits, sorted strings of three or
    four wrong letters (0.17 -> 0.004)."""
    ordered = list(answer) == sorted(answer)
    out = answer
    for _ in range(rng.randint(1, max(len(answer), 1))):
        chars = list(out)
        i = rng.randrange(len(chars)) if chars else 0
        kind = rng.choice(("drop", "repeat", "replace")) if len(chars) > 1 else "replace"
        if kind == "drop":
            del chars[i]
        elif kind == "repeat":
            chars.insert(i, chars[i])
        else:
            pool = string.digits if answer[:1].isdigit() else string.ascii_lowercase
            new = [c for c in pool if c not in answer]
            chars[i : i + 1] = [rng.choice(new)]
        if ordered:
            chars.sort()
        out = "".join(chars)
    return out if out != answer else wrong_answer(rng, answer)


Negatives = Literal["shuffle", "mixed"]


def preferences(
    name: str, *, split: Split, n: int, seed: int = 0, negatives: Negatives = "shuffle"
) -> list[dict[str, str]]:
    """``n`` preference pairs ``{prompt, chosen, rejected}`` of ``split`` (a reward model's data,
    ``algorithm.loss: reward_model``): the right answer preferred over :func:`wrong_answer`
    (``negatives: shuffle``), or, for ``mixed``, half of the time over :func:`edited_answer` (what
    a reward model that a policy optimises must rank low too)."""
    key = f"{name}:preferences:{split}:{seed}"  # shuffle: the pairs it wrote before mixed existed
    rng = random.Random(key if negatives == "shuffle" else f"{key}:{negatives}")

    def rejected(answer: str) -> str:
        if negatives == "mixed" and rng.random() < 0.5:
            return edited_answer(rng, answer)
        return wrong_answer(rng, answer)

    return [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": rejected(r["answer"])}
        for r in examples(name, split=split, n=n, seed=seed)
    ]


def write_preferences(
    name: str,
    out_dir: str | Path,
    *,
    train: int,
    eval: int,
    seed: int = 0,
    negatives: Negatives = "shuffle",
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` of :func:`preferences`; returns their paths."""
    out = Path(out_dir)
    kw = {"seed": seed, "negatives": negatives}
    return (
        write_jsonl(out / "train.jsonl", preferences(name, split="train", n=train, **kw)),
        write_jsonl(out / "eval.jsonl", preferences(name, split="eval", n=eval, **kw)),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.tasks", description=__doc__.splitlines()[0])
    p.add_argument("task", choices=list(TASKS))
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for path in write_task(a.task, a.out_dir, train=a.train, eval=a.eval, seed=a.seed):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
