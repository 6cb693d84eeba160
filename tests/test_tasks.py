"""Synthetic tasks: deterministic by seed, right answers, disjoint held-out split, noisy sort target."""

from __future__ import annotations

import random

import pytest

from asyncrl import tasks


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_same_seed_same_rows_other_seed_other_rows(name):
    a = tasks.examples(name, split="train", n=50, seed=3)
    assert a == tasks.examples(name, split="train", n=50, seed=3)
    assert a != tasks.examples(name, split="train", n=50, seed=4)


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_held_out_split_is_disjoint_and_distinct(name):
    train = tasks.examples(name, split="train", n=3000, seed=0)
    held = tasks.examples(name, split="eval", n=300, seed=0)
    held_prompts = [r["prompt"] for r in held]
    assert len(set(held_prompts)) == len(held_prompts)
    assert not {r["prompt"] for r in train} & set(held_prompts)
    # other seeds draw from the same partition: no seed leaks a held-out prompt into training
    other = tasks.examples(name, split="train", n=3000, seed=7)
    assert not {r["prompt"] for r in other} & set(held_prompts)


def test_answers_are_right():
    for r in tasks.examples("addition", split="train", n=200):
        a, b = r["prompt"].rstrip("=").split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert r["answer"] == str(int(a) + int(b)) == r["completion"]
    for r in tasks.examples("sort", split="eval", n=200):
        letters = r["prompt"].rstrip("=")
        assert 4 <= len(letters) <= 5 and r["answer"] == "".join(sorted(letters))
    for r in tasks.examples("reverse", split="train", n=200):
        assert r["answer"] == r["prompt"].rstrip("=")[::-1] == r["completion"]


def test_sort_sft_target_is_noisy_copy_or_sorted():
    rows = tasks.examples("sort", split="train", n=2000)
    copies = sum(r["completion"] == r["prompt"].rstrip("=") for r in rows)
    sorted_ = sum(r["completion"] == r["answer"] for r in rows)
    assert copies + sorted_ >= len(rows)  # an already-sorted input counts as both
    assert abs(copies / len(rows) - tasks.SORT_COPY_FRACTION) < 0.05


def test_eval_split_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than"):
        tasks.examples("addition", split="eval", n=2000)  # ~1,012 held-out addition prompts exist


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="addition"):
        tasks.get("sorting")


def test_score_is_exact_match():
    assert tasks.score(" 82\n", "82") == 1.0
    assert tasks.score("820", "82") == 0.0
    assert tasks.score("", "82") == 0.0


def test_cli_writes_jsonl(tmp_path):
    assert tasks.main(["addition", str(tmp_path), "--train", "20", "--eval", "10"]) == 0
    train = list(tasks.read_jsonl(tmp_path / "train.jsonl"))
    held = list(tasks.read_jsonl(tmp_path / "eval.jsonl"))
    assert len(train) == 20 and len(held) == 10
    assert set(train[0]) == {"prompt", "answer", "completion"}


def test_mixed_negatives_keep_a_sorted_answers_form_with_other_letters():
    """negatives: mixed (the RLHF demo's reward model): half the rejected answers are the right
    letters shuffled, half edits that stay sorted but drop, repeat or replace letters, near and far
    (a reward model that never saw those ranks a policy's sorted wrong letters high)."""
    rows = tasks.preferences("sort", split="train", n=400, seed=0, negatives="mixed")
    assert rows == tasks.preferences("sort", split="train", n=400, seed=0, negatives="mixed")
    assert all(r["rejected"] != r["chosen"] for r in rows)
    shuffled = [r for r in rows if sorted(r["rejected"]) == sorted(r["chosen"])]
    edited = [r for r in rows if sorted(r["rejected"]) != sorted(r["chosen"])]
    assert 120 < len(shuffled) < 280 and 120 < len(edited) < 280
    assert all(list(r["rejected"]) == sorted(r["rejected"]) for r in edited)
    far = [r for r in edited if len(set(r["rejected"]) - set(r["chosen"])) >= 3]
    assert far, "no far misses"
    default = tasks.preferences("sort", split="train", n=50, seed=0)
    assert all(sorted(r["rejected"]) == sorted(r["chosen"]) for r in default)  # shuffles only
    rng = random.Random(0)
    assert all(tasks.edited_answer(rng, a) != a for a in ("a", "ab", "abcde", "42") * 50)
