"""The built-in engine's decode loop on a device that is not the host (:mod:`tests.device_tier`):
the model, its KV cache, the sampler's tensors and its generators on the pretend device, so the
CUDA branches run (``transfer.to_device`` from pinned memory, ``transfer.one_read``, generators
made for the model's device). It fails where CUDA would, counts the host's waits for the device
per step, and checks that those branches give the CPU branches' tokens, logprobs and routes.
Its weight updates too, in the engine's own threads: received, staged, fused and swapped in."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from asyncrl.engine.api import Engine, EngineConfig
from asyncrl.engine.batched_model import BatchedLM
from asyncrl.engine.sampling import EngineSamplingParams
from asyncrl.engine.scheduler import Request, Scheduler
from asyncrl.engine.weights import WeightStore
from tests.device_tier import DeviceMixError, PretendDevice
from tests.engine.test_fused import perturbed

PEER = Path(__file__).with_name("rank0_peer.py")


def requests(vocab: int, *, routes: bool) -> list[Request]:
    """Greedy, drawn with the engine's generator, seeded (a generator of its own), truncated,
    with stop tokens banned for a while, with the prompt's logprobs and top logprobs, one that
    only scores its prompt, and a one-token prompt's logprobs (none to compute)."""

    def p(**kw) -> EngineSamplingParams:
        return EngineSamplingParams.parse(kw, vocab_size=vocab)

    return [
        Request(
            [5, 6, 7, 8],
            p(temperature=0, max_new_tokens=6),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_routed_experts=routes,
        ),
        Request(
            [9, 10],
            p(temperature=0.8, top_p=0.9, max_new_tokens=5, min_new_tokens=3, sampling_seed=3),
            return_routed_experts=routes,
        ),
        Request([11, 12, 13], p(top_k=5, max_new_tokens=4), return_logprob=True),
        Request([11, 12, 13], p(max_new_tokens=0), return_logprob=True, logprob_start_len=1),
        Request([14], p(max_new_tokens=2), return_logprob=True, logprob_start_len=0),
    ]


def generate(model_dir, *, routes: bool, on_device: bool):
    """Every request to its end in this thread (the decode thread's loop, step by step), on the
    pretend device if ``on_device``: the engine is built inside the mode, so that it sees its
    model there. Returns the requests, the decode steps taken, the routes and the host's reads."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mode = PretendDevice() if on_device else contextlib.nullcontext()
    with torch.no_grad(), mode:
        lm = BatchedLM(model)
        assert lm.device.type == ("cuda" if on_device else "cpu")
        sch = Scheduler(lm, eos_ids=[2], decode_tail=lambda ids: "", seed=0)
        reqs = requests(lm.shape.vocab, routes=routes)
        sch.submit(reqs)
        for _ in range(20):
            if all(r.finish is not None for r in reqs):
                break
            sch._take_incoming()
            sch._admit()
            if sch.running:
                sch._decode()
        routed = [r.routed_experts().tolist() for r in reqs if r.return_routed_experts]
    return reqs, sch.stats.steps, routed, mode.reads if on_device else []


def by_function(reads) -> Counter:
    """The host's reads counted by the file and function of asyncrl that made them."""
    return Counter(r.where.split(":")[0] + " " + r.where.split(" ")[1] for r in reads)


def outputs(reqs: list[Request]) -> list[tuple]:
    return [
        (r.finish, r.output_ids, r.output_logprobs, r.output_top, r.input_logprobs, r.input_top)
        for r in reqs
    ]


def test_the_decode_loop_on_the_device_reads_once_a_step(tiny_qwen3):
    """Nothing of the host in device compute, the seeded request drawn with a generator of the
    device; one read per prefill and per decode step (every row's token, logprob and top
    logprobs together), one per request that asks for its prompt's logprobs; and what comes back
    is what the CPU branches give, bit for bit."""
    on_device, steps, _, found = generate(tiny_qwen3, routes=False, on_device=True)
    on_cpu, cpu_steps, _, _ = generate(tiny_qwen3, routes=False, on_device=False)
    # each to its length, or to an end token the model drew (which depends on the CPU's kernels:
    # the same on both sides)
    assert all(r.finish["type"] in ("length", "stop") for r in on_device)
    assert on_device[3].output_ids == [] and steps >= 1  # the one that scores its prompt
    assert outputs(on_device) == outputs(on_cpu) and steps == cpu_steps
    reads = by_function(found)
    assert set(reads) == {"engine/transfer.py one_read"}, reads
    prefills, scored = 1, 3  # all admitted at once; three want their prompt's logprobs
    assert sum(reads.values()) == prefills + steps + scored


def test_an_moe_engine_on_the_device_reads_its_routes_once_a_step(tiny_qwen3_moe):
    """The experts each position chose come back in one read per step, whatever the number of
    MoE layers, and equal the CPU branch's. Each MoE layer still reads its tokens per expert
    once a step: the engine runs the experts one by one over their tokens, as transformers does
    (its float32 numbers are the learner's; docs/moe.md)."""
    on_device, steps, routes, found = generate(tiny_qwen3_moe, routes=True, on_device=True)
    on_cpu, _, cpu_routes, _ = generate(tiny_qwen3_moe, routes=True, on_device=False)
    assert outputs(on_device) == outputs(on_cpu) and routes == cpu_routes
    asked = [r for r in on_device if r.return_routed_experts]
    assert [len(r) for r in routes] == [len(r.prompt_ids) + len(r.output_ids) - 1 for r in asked]
    reads = by_function(found)
    forwards, moe_layers = 1 + steps, 2
    assert reads == {
        "engine/transfer.py one_read": forwards + 3,
        "engine/batched_model.py _routes": forwards,
        "engine/batched_model.py _experts": forwards * moe_layers,
    }


def test_a_draw_needs_a_generator_of_the_tensors_device():
    """CUDA refuses a host generator for a draw on the device ("Expected a 'cuda' device type
    for generator"), and the tier with it."""
    with PretendDevice():
        probs = torch.full((2, 5), 0.2).to("cuda")
        with pytest.raises(DeviceMixError, match="host generator"):
            torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))
        g = torch.Generator(probs.device).manual_seed(0)
        assert torch.multinomial(probs, 1, generator=g).device.type == "cuda"
        with pytest.raises(DeviceMixError, match="device generator"):
            torch.multinomial(torch.full((5,), 0.2), 1, generator=g)


@contextlib.contextmanager
def in_threads(mode: PretendDevice, *runners: Callable[[Callable], object]):
    """The mode on in other threads as well (a mode is its thread's own): entered and left in
    each by the engine's own way of running code there (the decode thread's ``Engine.call``,
    the receiver thread's ``Receiver.run``)."""
    entered = []
    try:
        for run in runners:
            run(mode.__enter__)
            entered.append(run)
        yield
    finally:
        for run in reversed(entered):
            run(lambda: mode.__exit__(None, None, None))


@torch.no_grad()
def test_a_weight_update_lands_on_the_device_and_is_served_from_it(tiny_qwen3, tmp_path):
    """An engine's weight updates on the pretend device (its weight store called as its HTTP
    handlers call it), each part in the thread that runs it on a GPU: the receiver thread's broadcasts (gloo's into host tensors, moved to the device
    when staged; NCCL's into device tensors, which the fused projections adopt without a copy),
    a load from disk (safetensors gives host tensors), the swap in the decode thread, then a
    decode with what was swapped in. A host tensor installed as a weight fails the swap's
    ``.data =`` as a host tensor in device compute; the weights served are the ones sent."""
    group = "device_tier_update"
    peer = subprocess.Popen(
        [sys.executable, str(PEER), group], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = peer.stdout.readline()
        assert line.startswith("port "), line
        sends = [perturbed(tiny_qwen3, seed) for seed in range(5)]
        disk = tmp_path / "disk"
        disk.mkdir()
        save_file(dict(sends[4]), str(disk / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
        params = dict(model.named_parameters())
        with PretendDevice() as mode:
            lm = BatchedLM(model)
            eng = Engine(config=EngineConfig(model=str(tiny_qwen3)), hf_model=model)
            eng.store = store = WeightStore(model, eng, receive_buffers=lm.receive_buffers)
            eng.scheduler = Scheduler(lm, eos_ids=[], decode_tail=lambda ids: "", seed=0)
            eng.scheduler.start()
            try:
                with in_threads(mode, eng.call, store.receiver.run):
                    store.init_group(
                        master_address="127.0.0.1",
                        master_port=int(line.split()[1]),
                        rank_offset=1,
                        world_size=2,
                        group_name=group,
                        backend="gloo",
                    )

                    def decode() -> None:
                        r = Request(
                            [5, 6, 7, 8],
                            EngineSamplingParams.parse(
                                {"temperature": 0, "max_new_tokens": 3}, vocab_size=lm.shape.vocab
                            ),
                        )
                        eng.scheduler.submit([r])
                        assert r.done.wait(60) and eng.scheduler.error is None
                        assert r.finish["type"] == "length", r.finish

                    def served(named) -> bool:
                        return all(torch.equal(params[n], t) for n, t in named)

                    ways = [("list", "gloo"), ("flattened_bucket", "gloo")]
                    ways += [("list", "nccl"), ("flattened_bucket", "nccl")]
                    for i, (load_format, backend) in enumerate(ways):
                        # NCCL receives into tensors on the engine's device, gloo into host ones
                        # (WeightStore.receive_distributed): the group here is gloo, which fills
                        # either, named nccl to send the receive where NCCL's lands (a stand-in:
                        # NCCL needs a GPU)
                        store.backends[group] = backend
                        path = tmp_path / f"{i}.pt"
                        torch.save(sends[i], path)
                        store.begin()
                        peer.stdin.write(f"{load_format} {path}\n")
                        peer.stdin.flush()
                        store.update(
                            names=[n for n, _ in sends[i]],
                            dtypes=[t.dtype for _, t in sends[i]],
                            shapes=[list(t.shape) for _, t in sends[i]],
                            group_name=group,
                            load_format=load_format if load_format != "list" else None,
                            version=f"v{i + 1}",
                            abort_all=False,
                        )
                        staged = dict(store._staged)
                        assert not [n for n, t in staged.items() if mode.on_host(t)]
                        store.end()
                        assert served(sends[i]) and eng.version == f"v{i + 1}"
                        if backend == "nccl":  # received where it is served: no copy
                            received = {t.data_ptr() for t in staged.values()}
                            assert all(f.weight.data_ptr() in received for f in lm.fused.values())
                        decode()
                    store.load_from_disk(str(disk), version="v-disk", abort_all=False)
                    assert served(sends[4]) and eng.version == "v-disk"
                    decode()
                    store.destroy_group(group)
            finally:
                eng.close()
        peer.stdin.close()
        assert peer.wait(60) == 0
    finally:
        peer.kill()


def test_a_host_tensor_installed_as_a_weight_is_refused():
    """What the update test above relies on: a parameter of the device re-pointed at a host
    tensor (``param.data = t``: CUDA allows it, and the model would then compute on the host, or
    fail at its next step) is a host tensor in device compute; one of the device is not."""
    p = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    with PretendDevice():
        with pytest.raises(DeviceMixError, match="host tensor"):
            p.data = torch.ones(4)
        p.data = torch.ones(4).to("cuda")
        assert p.device.type == "cuda"
