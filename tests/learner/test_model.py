"""The learner's model: HF folder -> TorchTitan (Qwen3, Llama; tied and untied), logprob parity with
transformers (packed and unpacked), HF state dict and export round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl import recipe as recipe_mod
from asyncrl.learner.packing import make_sequence, pack
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

FIXTURES = ["tiny_qwen3", "tiny_qwen3_untied", "tiny_llama", "tiny_llama_tied"]


def make_trainer(model_dir, tmp_path, **sections):
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    data = {
        "model": {"path": str(model_dir), "max_seq_len": 256},
        "run": {"output_dir": str(tmp_path)},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(data)), checkpointing=False)


def random_sequences(n: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(5, 40))) for _ in range(n)]


def random_batch(vocab: int, seed: int = 0):
    """Four random samples at version 0, one group each (μ's logprobs 0: a step that moves)."""
    from asyncrl import wire
    from asyncrl.learner.source import Batch

    samples = [
        wire.Sample(
            id=str(i),
            group_id=str(i),
            prompt_ids=s[:2].astype(np.int32),
            completion_ids=s[2:].astype(np.int32),
            behavior_logprobs=np.zeros(len(s) - 2, np.float32),
            versions=np.zeros(len(s) - 2, np.int32),
            loss_mask=np.ones(len(s) - 2, np.float32),
        )
        for i, s in enumerate(random_sequences(4, vocab, seed))
    ]
    return Batch(groups=[wire.Group(id=s.id, samples=[s]) for s in samples], version=0, stats={})


def hf_logprobs(model_dir, seqs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(s)[None]
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            out.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


@pytest.mark.parametrize("fixture", FIXTURES)
def test_logprobs_match_transformers_packed_and_unpacked(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    tr = make_trainer(model_dir, tmp_path)
    vocab = tr.models.spec.model.vocab_size
    seqs = random_sequences(5, vocab)
    # prompt = first token, completion = the rest: every position is a trained token
    items = [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(seqs)]
    want = hf_logprobs(model_dir, seqs)
    unpacked = tr.logprobs([pack([it]) for it in items])
    for got, ref in zip(unpacked, want, strict=True):
        assert_logits_close(got, ref)
    (packed,) = tr.logprobs([pack(items)])
    assert_logits_close(packed, torch.cat(want))
    # the documents really are kept apart: the same row read as one document differs
    glued = pack(items)
    glued.positions = torch.arange(glued.num_tokens)[None]
    glued.doc_lengths = (glued.num_tokens,)
    (leaky,) = tr.logprobs([glued])
    assert (leaky - torch.cat(want)).abs().max() > 1e-3


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_hf_state_dict_and_export_round_trip(fixture, request, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    tr = make_trainer(model_dir, tmp_path, algorithm={"loss": "sft"})
    original = load_file(str(model_dir / "model.safetensors"))
    sd = tr.hf_state_dict()
    assert set(sd) == set(original)
    for k, v in original.items():
        assert torch.equal(sd[k], v), k
    # take a step so the export differs from the input, then check it loads with equal logits

    vocab = tr.models.spec.model.vocab_size
    tr.step(random_batch(vocab, seed=1))
    seqs = random_sequences(4, vocab, seed=1)  # the batch's sequences
    out = tr.export_hf(tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.as_tensor(seqs[0])[None]
    with torch.no_grad():
        ref = hf(ids).logits
        got = tr.models.actor.lm_head(tr.models.actor(ids, torch.arange(ids.shape[1])[None]))
    assert_logits_close(got, ref)
    assert not torch.equal(hf.state_dict()["model.norm.weight"], original["model.norm.weight"])
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()


def test_attention_choice_follows_the_device_and_what_imports():
    from asyncrl.learner.attention import choose_attention

    def pick(kind, cap, present=()):
        return choose_attention(
            kind, on_cpu=cap is None, capability=cap, importable=lambda m: m in present
        )[0]

    assert pick("auto", None) == "sdpa"  # CPU: flex has no CPU backward, varlen no kernel
    assert pick("auto", (8, 0)) == "varlen"  # A100: PyTorch's own flash kernels
    # H100 without FA3: no ModuleNotFoundError at build, and not flex, which compiles for minutes
    # at every new row length (issue #44): the per-document SDPA on PyTorch's fused kernels
    assert pick("auto", (9, 0)) == "sdpa"
    assert pick("auto", (9, 0), {"flash_attn_interface"}) == "varlen"
    assert pick("auto", (10, 0), {"flash_attn_interface"}) == "sdpa"  # B200 needs FA4
    assert pick("auto", (10, 0), {"flash_attn.cute.interface"}) == "varlen"
    assert pick("flex", (9, 0)) == "flex" and pick("sdpa", (9, 0)) == "sdpa"
    why = choose_attention("flex", on_cpu=False, capability=(9, 0), importable=lambda m: False)[1]
    assert "compiles with max_autotune for each new packed-row length" in why  # the doctor says so
    with pytest.raises(
        ValueError, match="model.attention: varlen .* FA3, but flash_attn_interface"
    ):
        pick("varlen", (9, 0))
