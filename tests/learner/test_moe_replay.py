"""Routing replay in the learner (issue #55, ``algorithm.routing_replay``): with a sample's
recorded experts, TorchTitan's router sends every token to those experts, gated by its current
scores there; the forward then equals transformers' with its routers forced to the same experts,
the router still gets a gradient, and without replay nothing changes (bitwise). The agreement of
the learner's own top-k with the recorded one is logged every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncrl.learner import passes
from asyncrl.learner.packing import make_sequence, pack
from asyncrl.learner.routing import agreement, routers
from tests.learner.test_model import hf_logprobs, make_trainer, random_batch, random_sequences
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

EXPERTS = 8


def own_routes(tr, seqs) -> list[np.ndarray]:
    """The learner's own top-k for every input position of each sequence, alone in its row:
    ``[len - 1, moe_layers, top_k]``, read with hooks on its routers."""
    out = []
    for i, s in enumerate(seqs):
        got = []
        hooks = [
            r.register_forward_hook(lambda _m, _i, o, got=got: got.append(o[1][0].clone()))
            for r in routers(tr.models.actor)
        ]
        tr.logprobs([pack([make_sequence(i, s[:1], s[1:])])])
        for h in hooks:
            h.remove()
        out.append(torch.stack(got, 1).numpy())
    return out


def forced_hf_logprobs(model_dir, seqs, routes) -> list[torch.Tensor]:
    """transformers' Qwen3-MoE with each router's choice replaced by ``routes`` (the last
    position, which predicts nothing trained, keeps its own), gated as the learner's replay gates:
    softmax of the router's logits gathered at those experts, renormalized (norm_topk_prob)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    out = []
    for s, r in zip(seqs, routes, strict=True):
        for j, gate in enumerate(gates):

            def forced(h, gate=gate, j=j, r=r):
                h = h.reshape(-1, gate.hidden_dim)
                logits = F.linear(h, gate.weight)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                own = probs.topk(gate.top_k, dim=-1).indices
                ids = torch.cat([torch.as_tensor(r[:, j], dtype=torch.long), own[-1:]])
                top = probs.gather(-1, ids)
                if gate.norm_topk_prob:
                    top = top / top.sum(-1, keepdim=True)
                return logits, top.to(logits.dtype), ids

            gate.forward = forced
        with torch.no_grad():
            ids = torch.as_tensor(s)[None]
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        out.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


def test_replay_routes_tokens_to_the_recorded_experts_and_the_router_learns(
    tiny_qwen3_moe, tmp_path
):
    tr = make_trainer(tiny_qwen3_moe, tmp_path, algorithm={"routing_replay": True})
    seqs = random_sequences(3, tr.models.spec.model.vocab_size, seed=2)
    own = own_routes(tr, seqs)
    assert own[0].shape == (len(seqs[0]) - 1, 2, 2)
    # other experts than the learner's own, on purpose: every position, every MoE layer
    other = [(o + 1) % EXPERTS for o in own]
    items = [
        make_sequence(i, s[:1], s[1:], routed_experts=r.astype(np.uint8))
        for i, (s, r) in enumerate(zip(seqs, other, strict=True))
    ]
    want = forced_hf_logprobs(tiny_qwen3_moe, seqs, other)
    free = hf_logprobs(tiny_qwen3_moe, seqs)
    agreement(tr.models.actor, reset=True)
    for got, ref, unforced in zip(
        tr.logprobs([pack([it]) for it in items]), want, free, strict=True
    ):
        assert_logits_close(got, ref)
        assert (ref - unforced).abs().max() > 1e-3  # the forced experts change the numbers
    (packed,) = tr.logprobs([pack(items)])
    assert_logits_close(packed, torch.cat(want))
    # the first MoE layer sees the same hidden states either way: its own choice never agrees
    agree, total = agreement(tr.models.actor).tolist()
    # two passes (alone, packed), two MoE layers, every input position
    assert total == 2 * 2 * sum(len(s) - 1 for s in seqs) and agree < total
    # the gating weights are the current router's scores: its gate gets a gradient
    model = tr.models.actor
    model.zero_grad(set_to_none=True)
    mb = pack(items).to(tr.models.device)
    h = passes.hidden(tr.models, mb, model)
    logp = torch.log_softmax(model.lm_head(h[0, mb.sel]).float(), -1)
    logp.gather(1, mb.labels[0, mb.sel, None]).sum().backward()
    for r in routers(model):
        g = r.gate.weight.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        assert g is not None and g.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_without_replay_routes_change_nothing_and_agreement_is_counted(tiny_qwen3_moe, tmp_path):
    tr = make_trainer(tiny_qwen3_moe, tmp_path)  # routing_replay off: the default
    seqs = random_sequences(3, tr.models.spec.model.vocab_size, seed=3)
    own = own_routes(tr, seqs)
    plain = [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(seqs)]
    agreement(tr.models.actor, reset=True)
    base = tr.logprobs([pack([it]) for it in plain])
    assert agreement(tr.models.actor).tolist() == [0.0, 0.0]  # no routes: nothing counted
    for routes, agreed in ((own, 1.0), ([(o + 1) % EXPERTS for o in own], 0.0)):
        items = [
            make_sequence(i, s[:1], s[1:], routed_experts=r.astype(np.uint8))
            for i, (s, r) in enumerate(zip(seqs, routes, strict=True))
        ]
        got = tr.logprobs([pack([it]) for it in items])
        for g, b in zip(got, base, strict=True):
            assert torch.equal(g, b)  # bitwise: the router chose as without routes
        agree, total = agreement(tr.models.actor, reset=True).tolist()
        # every input position of one pass, in each of the two MoE layers
        assert total == 2 * sum(len(s) - 1 for s in seqs) and agree == agreed * total


def test_a_step_logs_routing_agreement(tiny_qwen3_moe, tmp_path):
    """The metric is there when the samples carry routes, replay on or off, and absent when they
    carry none."""
    tr = make_trainer(tiny_qwen3_moe, tmp_path, algorithm={"routing_replay": True})
    vocab = tr.models.spec.model.vocab_size
    assert "learner/routing_agreement" not in tr.step(random_batch(vocab, seed=1)).metrics
    batch = random_batch(vocab, seed=2)
    seqs = random_sequences(4, vocab, seed=2)
    for g, r in zip(batch.groups, own_routes(tr, seqs), strict=True):
        g.samples[0].routed_experts = r.astype(np.uint8)
    metrics = tr.step(batch).metrics
    assert 0.9 < metrics["learner/routing_agreement"] <= 1.0
