"""Rollout data: local files through HF datasets, malformed rows reported, a resumable position."""

from __future__ import annotations

import json
import logging

import pytest

from asyncrl.rollout.data import PromptDataError, PromptSource, load_prompt_rows, render_prompt


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
