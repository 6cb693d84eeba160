"""LoRA on the learner (asyncrl/learner/lora.py): adapters on the TorchTitan Qwen3 that are exactly
PEFT's (q, k, v separate on the fused wqkv), a frozen base that stays bitwise unchanged while only the
adapters train and hold AdamW state, checkpoints of the adapters alone, the weight snapshot under the
wire names, and the PEFT / merged exports that transformers + PEFT load to the learner's logprobs."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from asyncrl import recipe as recipe_mod
from asyncrl.learner import lora as lora_mod
from asyncrl.learner.packing import make_sequence, pack
from asyncrl.learner.passes import hidden
from asyncrl.weights.exports import VERSION_FILE, is_adapter_export, latest_export
from tests.learner.test_model import hf_logprobs, make_trainer, random_sequences
from tests.learner.test_step import rl_batch
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 4, "alpha": 8.0}
RL = {"learner": {"lr": 1e-2, "grad_clip": 1.0, "lora": LORA}, "buffer": {"max_staleness": 8}}
# Two ranks against one: B is zero at step 0, so on the second step some A entries get gradients of
# a few 1e-8, Adam's default ε, where its g/(√v + ε) turns the reductions' rounding into a third of
# a step; a larger ε keeps the runs' agreement at the rounding's own size.
TWO_RANKS = RL | {"learner": RL["learner"] | {"eps": 1e-4}}


def lora_trainer(model_dir, tmp_path, **sections):
    return make_trainer(model_dir, tmp_path, **(RL | sections))


def local(model, trainable: bool) -> dict[str, torch.Tensor]:
    """This rank's shard of every trainable (or every frozen) parameter, copied."""
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad == trainable
    }


def adapters(model) -> dict[str, torch.Tensor]:
    return local(model, True)


def optimizer_state(tr) -> list[torch.Tensor]:
    """AdamW's state of every parameter it holds, in the optimizer's order (local shards)."""
    out = []
    for opt in tr.models.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for k in sorted(opt.state[p]):
                    v = opt.state[p][k]
                    out.append((v.to_local() if isinstance(v, DTensor) else v).clone())
    return out


def learner_logprobs(tr, seqs) -> list[torch.Tensor]:
    items = [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(seqs)]
    with torch.no_grad():
        return [lp.clone() for lp in tr.logprobs([pack([it]) for it in items])]


def peft_logprobs(model, seqs) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(s)[None]
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            out.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


@pytest.mark.parametrize("loss", ["ppo", "sft"])
def test_step_zero_is_the_base_and_only_adapters_train(tiny_qwen3, tmp_path, loss):
    tr = lora_trainer(tiny_qwen3, tmp_path, algorithm={"loss": loss})
    seqs = random_sequences(3, tr.models.spec.model.vocab_size)
    # B = 0: the adapted model is the base model
    for got, ref in zip(learner_logprobs(tr, seqs), hf_logprobs(tiny_qwen3, seqs), strict=True):
        assert_logits_close(got, ref)
    base, start = local(tr.models.actor, False), adapters(tr.models.actor)
    # every target of every layer: q, k, v each their own A (r, in) and B (out, r) on wqkv
    assert len(start) == 2 * 2 * len(TARGETS)
    assert all(".lora." in n for n in start) and len(base) > 0
    for _ in range(3):
        tr.step(rl_batch(tr.models.spec.model.vocab_size, seed=tr.version))
    after = local(tr.models.actor, False) | adapters(tr.models.actor)
    assert all(torch.equal(after[n], base[n]) for n in base)  # bitwise: the base is frozen
    assert all(not torch.equal(after[n], start[n]) for n in start)  # every A and B moved
    # AdamW's two moments exist for the adapters only
    state = [s for opt in tr.models.optimizers for s in opt.state.values()]
    moments = sum(s[k].numel() for s in state for k in ("exp_avg", "exp_avg_sq"))
    assert moments == 2 * sum(p.numel() for p in start.values()) == 2 * 22_528


def test_weight_snapshot_is_the_adapters_under_the_wire_names(tiny_qwen3, tmp_path):
    tr = lora_trainer(tiny_qwen3, tmp_path)
    tr.step(rl_batch(tr.models.spec.model.vocab_size))
    sd = tr.hf_state_dict(torch.bfloat16)
    hidden, heads, kv, head_dim, ffn = 128, 4, 2, 32, 512
    outs = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim}
    outs |= {"o_proj": hidden, "gate_proj": ffn, "up_proj": ffn, "down_proj": hidden}
    want = {}
    for i in range(2):
        for t, out in outs.items():
            parent = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            inp = ffn if t == "down_proj" else heads * head_dim if t == "o_proj" else hidden
            want[f"model.layers.{i}.{parent}.{t}.lora_A.weight"] = (4, inp)
            want[f"model.layers.{i}.{parent}.{t}.lora_B.weight"] = (out, 4)
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    # B unscaled: the parameter itself (one rank: the full tensor)
    b = adapters(tr.models.actor)["layers.1.feed_forward.w2.lora.pairs.down_proj.B"]
    assert torch.equal(sd["model.layers.1.mlp.down_proj.lora_B.weight"], b.bfloat16())


def test_adapter_and_merged_exports_load_in_transformers_to_the_learners_logprobs(
    tiny_qwen3, tmp_path
):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = LORA | {"targets": ["q_proj", "v_proj", "down_proj"]}  # PEFT's wqkv with k left out
    tr = lora_trainer(tiny_qwen3, tmp_path, learner=RL["learner"] | {"lora": lora})
    for _ in range(2):
        tr.step(rl_batch(tr.models.spec.model.vocab_size, seed=tr.version))
    seqs = random_sequences(4, tr.models.spec.model.vocab_size, seed=3)
    want = learner_logprobs(tr, seqs)
    base = hf_logprobs(tiny_qwen3, seqs)
    assert max(float((w - b).abs().max()) for w, b in zip(want, base, strict=True)) > 1e-3

    folder = tr.export_hf(tmp_path / "hf" / "v2", dtype="float32")
    assert is_adapter_export(folder) and not (folder / "config.json").exists()
    assert latest_export(tmp_path / "hf") == (folder, 2)
    assert json.loads((folder / VERSION_FILE).read_text()) == {"version": 2}
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (4, 8.0, lora["targets"])
    assert cfg["base_model_name_or_path"] == str(tiny_qwen3.resolve())
    keys = set(load_file(folder / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 2 * 3
    # PEFT's own loader, and transformers' (an adapter folder: base_model_name_or_path + adapter)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, folder).eval()
    auto = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for model in (peft, auto):
        for got, ref in zip(peft_logprobs(model, seqs), want, strict=True):
            assert_logits_close(got, ref)

    tr.config.learner.lora.export = "merged"  # the same trainer, the other export
    merged = tr.export_hf(tmp_path / "merged", dtype="float32")
    assert (merged / "config.json").is_file() and not is_adapter_export(merged)
    for got, ref in zip(hf_logprobs(merged, seqs), want, strict=True):
        assert_logits_close(got, ref)
    # PEFT's merge of the adapter export gives the same weights
    folded = peft.merge_and_unload().state_dict()
    (weights,) = merged.glob("*.safetensors")
    mine = load_file(weights)
    assert (
        set(mine) <= set(folded)
        and max(float((mine[k] - folded[k]).abs().max()) for k in mine) < 1e-6
    )


def test_checkpoint_holds_what_trains_and_a_resume_gets_it_back(tiny_qwen3, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    data = {
        "model": {"path": str(tiny_qwen3), "max_seq_len": 256},
        "run": {"output_dir": str(tmp_path), "name": "lora", "resume": True},
    } | RL
    cfg = TrainerConfig.from_recipe(recipe_mod.from_dict(data))
    tr = Trainer(cfg)
    for _ in range(2):
        tr.step(rl_batch(tr.models.spec.model.vocab_size, seed=tr.version))
    assert tr.save_checkpoint(force=True)
    tr.wait_for_checkpoint()
    trained = adapters(tr.models.actor)
    moments = optimizer_state(tr)
    tr.close()
    meta = FileSystemReader(str(tr.checkpoints.folder / "step-2")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("layers.")]
    assert model_keys and all(".lora." in k for k in model_keys)  # no base weight saved
    assert not any(
        k.startswith(("tok_embeddings", "norm", "lm_head")) for k in meta.state_dict_metadata
    )

    again = Trainer(cfg)
    assert again.version == 2
    got = adapters(again.models.actor)
    assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in got)
    # the base is model.path's again, and the optimizer's moments came back
    for got_lp, ref in zip(
        learner_logprobs(again, random_sequences(2, 99)),
        learner_logprobs(tr, random_sequences(2, 99)),
        strict=True,
    ):
        assert torch.equal(got_lp, ref)
    state = optimizer_state(again)
    assert len(state) == len(moments) == 3 * len(got)  # step, exp_avg, exp_avg_sq
    assert all(torch.equal(a, b) for a, b in zip(state, moments, strict=True))
    again.close()


def test_llama_with_lora_is_a_one_line_error(tiny_llama, tmp_path):
    from asyncrl.learner.model_spec import ModelConfigError

    with pytest.raises(ModelConfigError, match=r"^learner\.lora: only Qwen3 .* permutes"):
        lora_trainer(tiny_llama, tmp_path)


TIMINGS = ("learner/step_s", "learner/trained_tokens_per_s", "learner/max_rss_gib")


@pytest.mark.parametrize(
    ("ranks", "tp", "elements"),
    [
        # FSDP2 over both ranks: each holds half of every adapter
        (2, 1, 22_528),
        # one tensor-parallel group: A split as its base's columns on wo / w2 and replicated on
        # wqkv / w1 / w3, B split as its base's rows on those and replicated on wo / w2
        (2, 2, 29_696),
        # two groups of two, FSDP2 over the groups: each rank half of what a TP 2 rank holds
        (4, 2, 29_696),
    ],
    ids=["fsdp2", "tp2", "tp2-fsdp2"],
)
@pytest.mark.slow
def test_two_ranks_shard_the_adapters_and_train_them_as_one_rank(
    tiny_qwen3, tmp_path, ranks, tp, elements
):
    """2 ranks under torchrun (gloo), or 4: FSDP2 shards the adapters with their blocks, and tensor
    parallelism splits them as its plan splits their base Linears; each rank's base shards stay
    bitwise, its adapter shards move and only they hold AdamW moments, and a checkpoint resumes
    them bitwise; each step's loss and metrics, the gathered snapshot, the adapter export and the
    merged export equal a one-rank run's (up to the order of the reductions)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.numerics import assert_close_rel

    out = tmp_path / "two"
    script = Path(__file__).with_name("lora_two_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    p = subprocess.run(
        [*cmd, str(ranks), str(script), str(tiny_qwen3), str(out), str(tp)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    found = json.loads((out / "found.json").read_text())
    assert len(found) == ranks
    assert all(r["base_unchanged"] and r["adapters_moved"] and r["resumed"] for r in found)
    # what the ranks hold of the adapters, and AdamW's two moments for their shards only
    assert sum(r["adapter_elements"] for r in found) == elements
    assert all(r["moment_elements"] == 2 * r["adapter_elements"] for r in found)

    tr = make_trainer(tiny_qwen3, tmp_path / "one", **TWO_RANKS)
    steps = []
    for _ in range(2):
        res = tr.step(rl_batch(tr.models.spec.model.vocab_size, seed=tr.version))
        steps.append({"loss": res.loss, **res.metrics})
    one = tr.hf_state_dict()
    tr.config.learner.lora.export = "merged"
    merged_one = tr.export_hf(tmp_path / "merged", dtype="float32")
    for mine, theirs in zip(steps, found[0]["steps"], strict=True):
        assert mine.keys() == theirs.keys()
        for k in mine.keys() - set(TIMINGS):
            assert_close_rel(mine[k], theirs[k], scale=1.0 if k == "loss" else 0.0)
    two = load_file(out / "snapshot.safetensors")
    exported = load_file(out / "export" / "adapter_model.safetensors")
    assert two.keys() == one.keys()
    assert {k.removeprefix("base_model.model.") for k in exported} == set(one)
    for k, v in one.items():
        # Adam's g/√v turns the reductions' rounding into up to ~1e-3 of a step (lr 1e-2)
        torch.testing.assert_close(two[k], v, rtol=1e-4, atol=2e-5)
        assert torch.equal(exported["base_model.model." + k], two[k])
    (merged_two,) = (out / "merged").glob("*.safetensors")
    (merged_one,) = merged_one.glob("*.safetensors")
    merged_one, merged_two = load_file(merged_one), load_file(merged_two)
    assert merged_two.keys() == merged_one.keys()
    for k, v in merged_one.items():
        torch.testing.assert_close(merged_two[k], v, rtol=1e-4, atol=2e-5)


def test_reference_is_the_actors_base_with_its_adapters_off(tiny_qwen3, tmp_path):
    """A KL term's π_ref is the LoRA actor itself (no second model) with the adapters off in the
    ref call: the steps equal those of a run with a π_ref model of its own (an offloaded reference
    is one: on CPU nothing is freed) bitwise, from the second step on, when B ≠ 0."""
    kl = {"loss": "ppo", "kl_coef": 0.5}
    runs = []
    for placement in ({}, {"ref": {"offload": True}}):
        tr = lora_trainer(tiny_qwen3, tmp_path, algorithm=kl, placement=placement)
        losses = [tr.step(rl_batch(99, seed=s)).loss for s in range(3)]
        runs.append((tr, losses, adapters(tr.models.actor)))
    (shared, l1, a1), (own, l2, a2) = runs
    assert shared.models.ref is shared.models.actor and shared.ref_source == "actor"
    assert own.models.ref is not own.models.actor and own.ref_source == "hf"
    assert l1 == l2 and all(torch.equal(a1[k], a2[k]) for k in a1)
    # the reference really is the base: with the adapters on, the same pass gives other logprobs
    seqs = random_sequences(2, 99)
    with lora_mod.disabled(shared.models.actor):
        base = learner_logprobs(shared, seqs)
    for got, ref in zip(base, hf_logprobs(tiny_qwen3, seqs), strict=True):
        assert_logits_close(got, ref)
    on = learner_logprobs(shared, seqs)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(base, on, strict=True))


def test_dropout_acts_in_the_training_forward_only(tiny_qwen3, tmp_path):
    """``learner.lora.dropout`` is a training regulariser (SFT's: an RL loss refuses it): the
    forward-only passes (π_ref, the logprobs that measure drift) are deterministic, the adapters'
    inputs whole."""
    tr = lora_trainer(
        tiny_qwen3,
        tmp_path,
        algorithm={"loss": "sft"},
        learner=RL["learner"] | {"lora": LORA | {"dropout": 0.5}},
    )
    tr.step(rl_batch(99))  # B ≠ 0: the adapters' inputs matter
    seqs = random_sequences(3, 99)
    first, second = learner_logprobs(tr, seqs), learner_logprobs(tr, seqs)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # and the training forward drops: two forwards with gradients differ
    items = [make_sequence(0, seqs[0][:1], seqs[0][1:])]
    h1, h2 = (hidden(tr.models, pack(items), tr.models.actor) for _ in range(2))
    assert not torch.equal(h1, h2)


def test_an_sft_run_with_adapters_exports_peft_folders_the_run_finds(tiny_qwen3, tmp_path):
    """`asyncrl learner` (SFT, one rank, in this process) with adapters: its exports are adapter
    folders, the newest one is the run's ``hf/latest``, and the loss goes down."""
    import yaml

    from asyncrl import tasks
    from asyncrl.learner.main import main
    from asyncrl.metrics import read_metrics

    train, _ = tasks.write_task("reverse", tmp_path / "data", train=256, eval=8)
    recipe = tmp_path / "sft.yaml"
    learner = {"lr": 3e-3, "batch_size": 16, "checkpoint_every": 2, "export_every": 2}
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "sft", "output_dir": str(tmp_path / "runs"), "steps": 4},
                "model": {"path": str(tiny_qwen3), "max_seq_len": 32},
                "data": {"path": str(train)},
                "algorithm": {"loss": "sft"},
                "learner": learner | {"lora": LORA},
                "logging": {"wandb": False},
            }
        )
    )
    assert main([str(recipe)]) == 0
    hf = tmp_path / "runs" / "sft" / "hf"
    assert all(is_adapter_export(hf / f"v{v}") for v in (2, 4))
    assert (hf / "latest").resolve() == (hf / "v4").resolve()
    assert latest_export(hf, at_most=3) == (hf / "v2", 2)
    losses = [m["loss"] for m in read_metrics(tmp_path / "runs" / "sft")]
    assert len(losses) == 4 and losses[-1] < losses[0]
