"""Greedy tokens and returned logprobs equal a plain transformers forward pass (fp32, 1e-5),
for one request and for requests of mixed lengths decoded together, on Qwen3, Llama and Qwen3-MoE."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.engine import EngineConfig, serve
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9], [12, 13, 14, 15, 16]]
MAX_NEW = [12, 5, 20, 9]


def _reference_logprobs(
    model, prompt: list[int], output: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) at every output position, from one full forward pass."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def _check(model, prompt, res, temperature):
    out = res["output_ids"]
    lps = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
    ref = _reference_logprobs(model, prompt, out, temperature)
    assert_logits_close(lps, ref.gather(1, torch.tensor(out)[:, None])[:, 0])
    if temperature == 0:
        assert ref.argmax(-1).tolist() == out


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_moe"])
def test_greedy_and_logprobs_equal_transformers(arch, request):
    path = request.getfixturevalue(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with (
        serve(EngineConfig(model=str(path))) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):

        def gen(prompt, n, temperature=0.0, **extra):
            sp = {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True, **extra}
            body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}
            return c.post("/generate", json=body).json()

        # one request alone
        single = gen(PROMPTS[1], 16)
        _check(model, PROMPTS[1], single, 0.0)
        # mixed lengths in one batch call: prefilled together, decoded together, leaving at different steps
        batch = c.post(
            "/generate",
            json={
                "input_ids": PROMPTS,
                "sampling_params": [
                    {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW
                ],
                "return_logprob": True,
            },
        ).json()
        for p, res, n in zip(PROMPTS, batch, MAX_NEW, strict=True):
            assert len(res["output_ids"]) == n
            _check(model, p, res, 0.0)
        assert batch[1]["output_ids"][:5] == single["output_ids"][:5]
        # requests arriving while others run (continuous batching) give the same tokens
        results: dict[int, dict] = {}

        def worker(i):
            results[i] = gen(PROMPTS[i], MAX_NEW[i])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, p in enumerate(PROMPTS):
            assert results[i]["output_ids"] == batch[i]["output_ids"]
            _check(model, p, results[i], 0.0)
        # sampled tokens: the logprob is log_softmax(logits / T), before top-k/top-p truncation
        sampled = gen(PROMPTS[0], 10, temperature=0.7, top_k=5, top_p=0.8, sampling_seed=3)
        _check(model, PROMPTS[0], sampled, 0.7)


def test_prompt_logprobs_equal_transformers(tiny_qwen3):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    prompt = PROMPTS[1]
    with (
        serve(EngineConfig(model=str(tiny_qwen3))) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        m = c.post("/generate", json=body).json()["meta_info"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    got = m["input_token_logprobs"]
    assert got[0] == [None, prompt[0], None]
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert_logits_close([lp for lp, _, _ in got[1:]], want)


def _tiny_config(cfg_cls, **kw):
    """A 2-layer, hidden-64 config of ``cfg_cls`` with grouped-query attention (4 heads, 2 KV)."""
    return cfg_cls(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **kw,
    )


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_llama_family_models_decode_exactly(arch):
    """Qwen2 (q/k/v biases) and Mistral run through the same slot-cache forward, exactly."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from asyncrl.engine.batched_model import BatchedLM

    cls, cfg_cls = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
        "mistral": (MistralForCausalLM, MistralConfig),
    }[arch]
    torch.manual_seed(0)
    cfg = _tiny_config(cfg_cls, sliding_window=64)
    model = cls(cfg).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    lm = BatchedLM(model)
    assert lm.shape.context == (
        64 if arch == "mistral" else 128
    )  # Qwen2's window is off by default
    cache = lm.new_cache()
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    logits, _ = lm.prefill(cache, 0, seqs)
    for _ in range(4):
        for s, row in zip(seqs, logits, strict=True):
            s.append(int(row.argmax()))
        logits = lm.decode(cache, [s[-1] for s in seqs], [len(s) - 1 for s in seqs])
    with torch.no_grad():
        for s, row in zip(seqs, logits, strict=True):
            ref = model(torch.tensor([s])).logits[0, -1]
            assert_logits_close(row, ref)


@torch.no_grad()
def test_swapped_weights_reach_the_fused_projections(tiny_qwen3):
    """The engine runs q/k/v and gate/up as one matmul each and the q/k norms per head. A swap
    re-points parameters: prepared (the engine's path) or not, the forward must follow it."""
    import copy

    from asyncrl.engine.batched_model import BatchedLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    ref = copy.deepcopy(model)
    lm = BatchedLM(model)
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    g = torch.Generator().manual_seed(3)

    def fresh(name: str) -> torch.Tensor:
        return torch.randn(params[name].shape, generator=g) * 0.2

    def check() -> None:
        cache = lm.new_cache()
        seq = [5, 6, 7, 8]
        logits, _ = lm.prefill(cache, 0, [seq])
        seq.append(int(logits[0].argmax()))
        logits = lm.decode(cache, [seq[-1]], [len(seq) - 1])
        want = ref(torch.tensor([seq])).logits[0, -1]
        assert_logits_close(logits[0], want)

    prepared = {
        n: fresh(n)
        for n in (
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.0.self_attn.k_norm.weight",
        )
    }
    staged = lm.prepare(prepared)
    assert "model.layers.0.self_attn.q_proj.weight" in staged  # the group moves together
    for n, t in staged.items():
        params[n].data = t
    lm.refresh()
    for n, t in prepared.items():
        ref_params[n].data.copy_(t)
    check()

    name = "model.layers.0.mlp.gate_proj.weight"  # not prepared: refresh fuses it itself
    params[name].data = fresh(name)
    ref_params[name].data.copy_(params[name].data)
    lm.refresh()
    check()


@torch.no_grad()
def test_a_prepared_swap_carries_qkv_biases():
    """Qwen2's q/k/v biases are fused with their weights; a prepared swap of a bias reaches the
    forward pass."""
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.engine.batched_model import BatchedLM

    torch.manual_seed(0)
    cfg = _tiny_config(Qwen2Config)
    model = Qwen2ForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    lm = BatchedLM(model)
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    before, _ = lm.prefill(lm.new_cache(), 0, [[5, 6, 7, 8]])
    name = "model.layers.1.self_attn.k_proj.bias"
    new = {name: torch.randn(32)}
    for n, t in lm.prepare(new).items():
        params[n].data = t
    lm.refresh()
    ref_params[name].data.copy_(new[name])
    logits, _ = lm.prefill(lm.new_cache(), 0, [[5, 6, 7, 8]])
    want = ref(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]
    assert_logits_close(logits[0], want)
    assert not torch.allclose(before, logits, atol=1e-3)  # the swap did change the output
