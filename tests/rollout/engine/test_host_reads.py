"""What a decode step asks of the device. On CUDA every value the host reads back (``.tolist()``,
``int(t)``, ``.item()``) waits for all the work queued before it, so a step that reads twice runs
as two half-steps with the GPU idle between them. CUDA is not here, but the reads are the same
calls on the CPU: these tests count them on the real model and sampler, and check that what comes
back in one read is what separate reads gave."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from asyncrl.rollout.engine import model as engine_model
from asyncrl.rollout.engine.model import BatchedLM
from asyncrl.rollout.engine.sampling import EngineSamplingParams, sample
from asyncrl.rollout.engine.transfer import to_device, to_host

READS = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Records every tensor method that hands a value to the host."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_a_decode_step_reads_the_device_once(tiny_qwen3):
    """The forward reads nothing back; the sampler reads once, every row's token, logprob and top
    logprobs together, whatever the rows ask for (greedy or drawn, seeded, tempered, truncated,
    stop tokens banned, top logprobs)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    lm = BatchedLM(model)
    cache = lm.new_cache()
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14], [15, 16, 17, 18]]
    lm.prefill(cache, 0, seqs)
    vocab = lm.shape.vocab

    def p(**kw) -> EngineSamplingParams:
        return EngineSamplingParams.parse(kw, vocab_size=vocab)

    params = [p(temperature=0), p(temperature=0.7, top_p=0.9), p(sampling_seed=3), p(top_k=4)]
    gens = [None, None, torch.Generator().manual_seed(3), None]
    with HostReads() as forward:
        logits = lm.decode(cache, [s[-1] for s in seqs], [len(s) for s in seqs])
    assert forward.reads == []
    with HostReads() as sampler:
        out = sample(
            logits,
            params,
            gens,
            torch.Generator().manual_seed(0),
            banned=[[3, 4], None, [7], None],
            top_logprobs=[2, 0, 3, 1],
        )
    assert sampler.reads == ["tolist"]
    # what came back in the one read is each row's own: its token, its logprob at its
    # temperature (stop tokens masked), and its top logprobs in order
    masked = logits.float().clone()
    masked[0, [3, 4]] = masked[2, 7] = float("-inf")
    temps = torch.tensor([1.0, 0.7, 1.0, 1.0])[:, None]
    logp = torch.log_softmax(masked / temps, -1)
    assert out.tokens[0] == int(masked[0].argmax()) and out.tokens[2] != 7
    assert out.tokens[3] in masked[3].topk(4).indices.tolist()
    for i, k in enumerate([2, 0, 3, 1]):
        assert isinstance(out.tokens[i], int)
        assert out.logprobs[i] == pytest.approx(float(logp[i, out.tokens[i]]), abs=1e-6)
        if k == 0:
            assert out.top[i] is None
            continue
        vals, ids = logp[i].topk(k)
        assert [t for _, t in out.top[i]] == ids.tolist()
        assert [v for v, _ in out.top[i]] == pytest.approx(vals.tolist(), abs=1e-6)


def test_one_read_back_is_exact():
    """Token ids and float32 logprobs packed into one float64 read come back as separate reads
    give them: ids as ints (float32 would round those above 2**24), logprobs to the bit, -inf
    (a banned token among the top ones) included."""
    ids = torch.tensor([[0], [151_935], [2**24 + 1]])
    lps = torch.tensor([[-0.1], [-1e-8], [float("-inf")]], dtype=torch.float32)
    top = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 30
    rows = to_host(ids, lps, top)
    assert [int(r[0]) for r in rows] == [t[0] for t in ids.tolist()]
    assert [r[1] for r in rows] == [x[0] for x in lps.tolist()]
    assert [r[2:] for r in rows] == top.tolist()
    assert to_device([1, 2, 3], torch.long, torch.device("cpu")).tolist() == [1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_precision_norm_is_transformers_to_the_bit(dtype):
    """The engine's fused RMSNorm in half precision rounds where transformers' Qwen3RMSNorm does
    (normalised in float32, rounded, then scaled by the weight), so it gives the same bits; a
    norm that scaled before rounding would not. For the layer norms and the per-head q/k norms."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(0)
    for shape in [(8, 1, 256), (3, 7, 256), (8, 1, 6, 64)]:
        norm = Qwen3RMSNorm(shape[-1], eps=1e-6).to(dtype)
        norm.weight.data = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        assert torch.equal(engine_model._rms(x, norm), norm(x))
        per_head = norm.weight.expand(shape[-2], -1)  # how the engine holds q/k norm weights
        assert torch.equal(engine_model._rms_w(x, per_head, 1e-6), norm(x))
        scaled_first = torch.nn.functional.rms_norm(x, (shape[-1],), norm.weight, 1e-6)
        assert not torch.equal(scaled_first, norm(x))
