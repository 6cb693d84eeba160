"""Mixture-of-experts policies in the learner (issue #55): the tiny Qwen3-MoE that
tools/make_tiny_model.py writes loads in transformers, maps to TorchTitan's MoE layers through the
state-dict adapter (HF names), gives transformers' log-probabilities, trains a step and exports an
HF folder transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.learner.packing import make_sequence, pack
from tests.learner.test_model import hf_logprobs, make_trainer, random_batch, random_sequences
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)


@pytest.fixture(scope="module")
def moe_mixed(tmp_path_factory):
    """Layer 0 dense (HF's ``mlp_only_layers``), layer 1 MoE; 4 experts, top-2, hidden 64."""
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("moe_mixed"),
        arch="qwen3_moe",
        hidden=64,
        experts=4,
        top_k=2,
        moe_intermediate=32,
        dense_layers=(0,),
        norm_topk_prob=False,
        seed=3,
    )


def test_tiny_moe_is_a_qwen3_moe_with_the_dense_models_tokenizer(tiny_qwen3_moe, tiny_qwen3):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_qwen3_moe / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (2, 64)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert hf.config.num_experts == 8
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny_qwen3_moe / name).read_bytes() == (tiny_qwen3 / name).read_bytes()


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "moe_mixed"])
def test_moe_logprobs_match_transformers_packed_and_unpacked(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    tr = make_trainer(model_dir, tmp_path)
    blocks = list(tr.models.actor.layers.values())
    want_moe = [fixture == "tiny_qwen3_moe" or i == 1 for i in range(len(blocks))]
    assert [b.moe_enabled for b in blocks] == want_moe
    seqs = random_sequences(5, tr.models.spec.model.vocab_size)
    items = [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(seqs)]
    want = hf_logprobs(model_dir, seqs)
    for got, ref in zip(tr.logprobs([pack([it]) for it in items]), want, strict=True):
        assert_logits_close(got, ref)
    (packed,) = tr.logprobs([pack(items)])
    assert_logits_close(packed, torch.cat(want))


def test_moe_trains_a_step_and_exports_an_hf_folder(tiny_qwen3_moe, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tr = make_trainer(tiny_qwen3_moe, tmp_path, algorithm={"loss": "sft"})
    original = load_file(str(tiny_qwen3_moe / "model.safetensors"))
    sd = tr.hf_state_dict()
    # every expert under its HF name, bitwise; no load-balancing bias (HF has no place for one)
    assert set(sd) == set(original)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in sd
    for k, v in original.items():
        assert torch.equal(sd[k], v), k
    assert not any("expert_bias" in k for k in tr.models.actor.state_dict())
    vocab = tr.models.spec.model.vocab_size
    tr.step(random_batch(vocab, seed=1))
    seqs = random_sequences(4, vocab, seed=1)  # the batch's sequences
    after = tr.hf_state_dict()
    # the router and the experts learn
    for k in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.up_proj.weight"):
        assert not torch.equal(after[k], original[k]), k
    out = tr.export_hf(tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.as_tensor(seqs[0])[None]
    with torch.no_grad():
        ref = hf(ids).logits
        got = tr.models.actor.lm_head(tr.models.actor(ids, torch.arange(ids.shape[1])[None]))
    assert_logits_close(got, ref)


def test_moe_config_errors_name_the_field(tmp_path):
    from asyncrl.learner.model_spec import ModelConfigError, build_spec
    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", arch="qwen3_moe", hidden=64, experts=4)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_experts_per_tok"] = 5
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="num_experts_per_tok 5 must be in 1..num_experts"):
        build_spec(folder)


def match_sglang(why: str) -> str:
    return (
        r"^generator\.kind: model\.path is a mixture of experts \(model_type qwen3_moe\) with "
        + why
        + r".*: SGLang 0\.5\.23 would serve another model without an error"
    )


def test_check_refuses_what_is_not_built_for_moe_in_one_line(tiny_qwen3_moe, tiny_qwen3, tmp_path):
    from asyncrl import recipe
    from asyncrl.recipe import RecipeError
    from tools.make_tiny_model import make_tiny_model

    moe = {"model": {"path": str(tiny_qwen3_moe)}}
    assert recipe.from_dict(moe).model.path == str(tiny_qwen3_moe)
    refused = [
        (
            {"learner": {"lora": {"rank": 8}}},
            r"^learner\.lora: model\.path is a mixture of experts \(model_type qwen3_moe\): LoRA",
        ),
        (
            {"placement": {"actor": {"tensor_parallel": 2}}},
            r"^placement\.actor\.tensor_parallel: 2 with model\.path is a mixture of experts",
        ),
        ({"algorithm": {"advantage": "gae"}}, r"^algorithm\.advantage: gae with model\.path is a"),
    ]
    for extra, match in refused:
        with pytest.raises(RecipeError, match=match) as e:
            recipe.from_dict(moe | extra)
        assert "\n" not in str(e.value)
    # SGLang generators: its Qwen3-MoE would serve a tied or partly dense checkpoint as another
    # model (docs/moe.md), so only Qwen's layout is served there
    sglang = {"generator": {"kind": "sglang", "urls": ["http://127.0.0.1:1"]}}
    with pytest.raises(RecipeError, match=match_sglang(r"tie_word_embeddings true")) as e:
        recipe.from_dict(moe | sglang)
    assert "\n" not in str(e.value)
    untied = make_tiny_model(tmp_path / "untied", arch="qwen3_moe", tie_embeddings=False)
    assert recipe.from_dict({"model": {"path": str(untied)}} | sglang).generator.kind == "sglang"
    dense_first = make_tiny_model(
        tmp_path / "dense_first", arch="qwen3_moe", tie_embeddings=False, dense_layers=(0,)
    )
    with pytest.raises(RecipeError, match=match_sglang(r"dense layers \[0\] \(mlp_only_layers")):
        recipe.from_dict({"model": {"path": str(dense_first)}} | sglang)
    # the same settings on the dense model pass
    dense = {"model": {"path": str(tiny_qwen3)}, "learner": {"lora": {"rank": 8}}}
    assert recipe.from_dict(dense).learner.lora.enabled
    # routing replay: an MoE's routes; a dense model and an offline data set have none
    assert recipe.from_dict(moe | {"algorithm": {"routing_replay": True}}).algorithm.routing_replay
    for bad, match in (
        (
            {"model": {"path": str(tiny_qwen3)}, "algorithm": {"routing_replay": True}},
            r"^algorithm\.routing_replay: true, but model\.path is not a mixture of experts "
            r"\(model_type qwen3\)",
        ),
        (
            moe | {"algorithm": {"routing_replay": True, "loss": "sft"}},
            r"^algorithm\.routing_replay: true with algorithm\.loss sft: its data set has no",
        ),
    ):
        with pytest.raises(RecipeError, match=match) as e:
            recipe.from_dict(bad)
        assert "\n" not in str(e.value)
