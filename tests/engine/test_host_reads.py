"""What a decode step asks of the device. On CUDA every value the host reads back (``.tolist()``,
``int(t)``, ``.item()``) waits for all the work queued before it, so a step that reads twice runs
as two half-steps with the GPU idle between them. CUDA is not here, but the reads are the same
calls on the CPU: these tests count them on the real model and sampler, and check that what the
CUDA path brings back in one read is what separate reads give."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from asyncrl.engine import batched_model as engine_model
from asyncrl.engine import transfer
from asyncrl.engine.batched_model import BatchedLM
from asyncrl.engine.sampling import EngineSamplingParams, sample

READS = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Records every tensor method that hands a value to the host, and the ``transfer.to_host``
    call it was made in (its frame; None outside one)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.calls: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
            f = inspect.currentframe()
            while f is not None and f.f_code is not transfer.to_host.__code__:
                f = f.f_back
            self.calls.append(f)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_a_decode_step_reads_the_device_once(tiny_qwen3):
    """The forward reads nothing back; the sampler reads in one ``to_host`` call (one transfer on
    CUDA), every row's token, logprob and top logprobs together, whatever the rows ask for
    (greedy or drawn, seeded, tempered, truncated, stop tokens banned, top logprobs)."""
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
    assert sampler.reads and None not in sampler.calls  # every read inside to_host
    assert len({id(f) for f in sampler.calls}) == 1  # and in one call of it
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


def test_the_cuda_read_back_is_one_transfer_and_exact():
    """What ``to_host`` does on CUDA (``one_read``, run here on CPU tensors): one copy to the
    host, then each part's list cut from it, equal to the part's own ``.tolist()`` value for
    value and type: ids as ints (float32 would round those above 2**24), logprobs to the bit,
    -inf (a banned token among the top ones) included."""
    g = torch.Generator().manual_seed(0)
    parts = (
        torch.tensor([0, 151_935, 2**24 + 1]),
        torch.tensor([-0.1, -1e-8, float("-inf")], dtype=torch.float32),
        torch.randn(3, 4, generator=g) * 30,
        torch.randint(0, 2**31, (3, 4), generator=g),
    )
    with HostReads() as seen:
        lists = transfer.one_read(parts)
    assert seen.reads == ["cpu"] + ["tolist"] * len(parts)  # the copy, then host lists

    def flat(xs: list) -> list:
        return [y for x in xs for y in (x if isinstance(x, list) else [x])]

    for got, p in zip(lists, parts, strict=True):
        assert got == p.tolist()
        assert [type(x) for x in flat(got)] == [type(x) for x in flat(p.tolist())]
    assert transfer.to_host(*parts) == lists  # the CPU path: part by part, the same lists
    # no rows (a one-token prompt's logprobs): empty lists, as .tolist() gives
    empty = (torch.zeros(0), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert transfer.one_read(empty) == [[], [], []]
    ids = transfer.to_device([1, 2, 3], torch.long, torch.device("cpu"))
    assert ids.dtype == torch.long and ids.tolist() == [1, 2, 3]


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
