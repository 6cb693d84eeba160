"""Rollout data: local files (jsonl of one shape without HF datasets, the rest through it), malformed
rows reported, a resumable position."""

from __future__ import annotations

import json
import logging

import pytest

from asyncrl.rollout.prompts import PromptDataError, PromptSource, load_prompt_rows, render_prompt


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_malformed_rows_are_reported_with_file_and_line(tmp_path, caplog):
    f = _write(
        tmp_path / "train.jsonl",
        [
            json.dumps({"prompt": "a=", "answer": "a"}),
            '{"prompt": "b=", "answer": ',  # truncated JSON
            json.dumps({"question": "c="}),  # no prompt field
            "",
            json.dumps({"prompt": 7, "answer": "x"}),  # not text
            json.dumps({"prompt": "d=", "answer": "d"}),
        ],
    )
    with caplog.at_level(logging.WARNING):
        ds, numbers, skipped = load_prompt_rows(f)
    assert [r["prompt"] for r in ds] == ["a=", "d="]
    assert numbers == [1, 6]
    assert len(skipped) == 3
    assert skipped[0].startswith(f"{f}:2: not valid JSON")
    assert skipped[1] == f"{f}:3: no 'prompt' field (data.prompt_key)"
    assert skipped[2].startswith(f"{f}:5: the prompt is a int")
    assert f"{f}:2" in caplog.text


def test_parquet_and_chat_messages(tmp_path):
    import datasets

    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
        {"prompt": [{"content": "no role"}], "answer": "2"},
    ]
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    ds, numbers, skipped = load_prompt_rows(path)
    assert len(ds) == 1 and numbers == [1]
    assert skipped and f"{path}:2:" in skipped[0]


def test_no_usable_rows_is_one_line_error(tmp_path):
    f = _write(tmp_path / "bad.jsonl", ["nope"])
    with pytest.raises(PromptDataError, match="no usable rows"):
        load_prompt_rows(f)
    with pytest.raises(PromptDataError, match="not found"):
        load_prompt_rows(tmp_path / "missing.jsonl")


def _source(n=10, **kw):
    return PromptSource([{"prompt": f"p{i}"} for i in range(n)], **kw)


def test_epochs_cover_every_row_once_in_a_seeded_order():
    src = _source(10, seed=3)
    first = [src.take().row["prompt"] for _ in range(10)]
    second = [src.take().row["prompt"] for _ in range(10)]
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(10))
    assert first != second  # reshuffled per epoch
    again = _source(10, seed=3)
    assert [again.take().row["prompt"] for _ in range(10)] == first


def test_restart_neither_repeats_nor_skips():
    """Delivered prompts are not served again; handed-out but undelivered ones are."""
    src = _source(10, seed=1)
    items = [src.take() for _ in range(6)]
    for it in items[:4]:
        src.done(it.index)
    state = json.loads(json.dumps(src.state_dict()))  # it travels as JSON/msgpack
    resumed = _source(10, seed=1)
    resumed.load_state_dict(state)
    after = [resumed.take() for _ in range(6)]
    assert [a.index for a in after[:2]] == [items[4].index, items[5].index]
    assert after[0].row == items[4].row
    seen = [it.row["prompt"] for it in items[:4]] + [a.row["prompt"] for a in after]
    assert sorted(seen) == sorted(f"p{i}" for i in range(10))


def test_state_for_other_data_is_refused():
    src = _source(10)
    with pytest.raises(PromptDataError, match="num_rows"):
        _source(11).load_state_dict(src.state_dict())


def test_shards_are_disjoint():
    a = _source(10, shard=(0, 2))
    b = _source(10, shard=(1, 2))
    pa = {a.take().row["prompt"] for _ in range(5)}
    pb = {b.take().row["prompt"] for _ in range(5)}
    assert not pa & pb and len(pa | pb) == 10


def test_render_with_chat_template(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    text, ids = render_prompt({"prompt": "2+2="}, tok, chat_template=True)
    assert text == "user: 2+2=\nassistant: "
    assert tok.decode(ids) == text
    text, ids = render_prompt({"prompt": "2+2="}, tok)
    assert text == "2+2=" and len(ids) == 4


def _arrow_rows(rows):
    """What ``datasets`` gives back for ``rows`` (None where it refuses them)."""
    import datasets

    try:
        return [dict(r) for r in datasets.Dataset.from_list(rows)]
    except Exception:
        return None


def _random_value(rng, depth=0):
    kind = rng.choice(
        ["none", "str", "int", "float", "bool", "list", "dict"][: 7 if depth < 2 else 5]
    )
    if kind == "none":
        return None
    if kind == "str":
        return rng.choice(["", "a", "é", "x y", "\U0001f600"])
    if kind == "int":
        return rng.choice([0, -3, 2**62, 2**63, -(2**63) - 1])
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e300, 2.0])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    keys = rng.sample(["role", "content", "name", "n"], rng.randint(0, 3))
    return {k: _random_value(rng, depth + 1) for k in keys}


def _mutate(rng, v):
    """``v`` itself, or ``v`` with one change of the kinds that change Arrow's schema."""
    if isinstance(v, dict) and v and rng.random() < 0.5:
        k = rng.choice(list(v))
        w = dict(v)
        op = rng.choice(["drop", "add", "reorder", "deeper"])
        if op == "drop":
            del w[k]
        elif op == "add":
            w["extra"] = 1
        elif op == "reorder":
            w = dict(reversed(list(w.items())))
        else:
            w[k] = _mutate(rng, w[k])
        return w
    if isinstance(v, list) and v and rng.random() < 0.5:
        return [*v[:-1], _mutate(rng, v[-1])]
    if rng.random() < 0.3:
        return _random_value(rng)
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return float(v)
    return v


def _row_like(row, rng):
    """``row``'s shape with some values nulled (a null fits any column)."""
    return {k: (None if rng.random() < 0.2 else v) for k, v in row.items()}


def test_rows_read_without_datasets_are_the_rows_datasets_gives_back():
    """The jsonl fast path (data._plain_rows) vouches for rows only where Arrow's round trip gives
    every row back as it was (key order and value types included); random rows of one shape and of
    nearly one shape, against ``datasets.Dataset.from_list`` itself."""
    import random

    from asyncrl.rollout.prompts import _plain_rows

    rng = random.Random(0)
    plain_seen = fallback_seen = 0
    for _ in range(400):
        base = {"prompt": "p", **{k: _random_value(rng) for k in rng.sample("abc", 2)}}
        rows = [_row_like(base, rng) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.6:
            i = rng.randrange(len(rows))
            rows[i] = _mutate(rng, rows[i])
        want = _arrow_rows(rows)
        got = _plain_rows(rows)
        if got is None:
            fallback_seen += 1
            continue
        plain_seen += 1
        assert want is not None, rows
        assert [list(r.items()) for r in got] == [list(r.items()) for r in want], rows
        assert repr(got) == repr(want), rows  # int stays int, -0.0 stays -0.0, keys in order
    assert plain_seen > 100 and fallback_seen > 50


def test_jsonl_of_one_shape_is_read_without_datasets_and_others_through_it(tmp_path):
    same = _write(
        tmp_path / "same.jsonl", [json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(3)]
    )
    rows, numbers, _ = load_prompt_rows(same)
    assert rows == [{"prompt": f"p{i}", "answer": i} for i in range(3)] and numbers == [1, 2, 3]
    assert isinstance(rows, list)
    mixed = _write(
        tmp_path / "mixed.jsonl",
        [json.dumps({"prompt": "a", "answer": 1}), json.dumps({"prompt": "b", "answer": 2.5})],
    )
    rows, _, _ = load_prompt_rows(mixed)
    assert not isinstance(rows, list)  # a datasets.Dataset: Arrow widens the ints, as before
    assert [r["answer"] for r in rows] == [1.0, 2.5]
    with pytest.raises(PromptDataError, match="do not share one schema"):
        load_prompt_rows(
            _write(
                tmp_path / "clash.jsonl",
                [
                    json.dumps({"prompt": "a", "answer": 1}),
                    json.dumps({"prompt": "b", "answer": "x"}),
                ],
            )
        )


def test_a_taken_row_is_a_copy_to_the_last_level():
    src = PromptSource([{"prompt": [{"role": "user", "content": "hi"}]}], shuffle=False)
    src.take().row["prompt"][0]["content"] = "changed by a workflow"
    assert src.take().row["prompt"][0]["content"] == "hi"
