"""asyncrl.memory: the doctor's memory plan against numbers computed by hand for Qwen3-0.6B and 8B.

The configurations are those of the published models' config.json files:

- Qwen3-0.6B: hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
  vocabulary 151,936, tied embeddings (tools/make_tiny_model.py FLAVOURS["qwen3-0.6b"]);
- Qwen3-8B: hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate 12288,
  vocabulary 151,936, untied embeddings.
"""

from __future__ import annotations

import math

import pytest

from asyncrl.learner.logprobs import chunk_tokens
from asyncrl.memory import (
    ModelDims,
    Phase,
    PlanError,
    RoleLayout,
    activation_bytes_per_token,
    generator_plan,
    in_flight_sequences,
    learner_plan,
    rank_plans,
    role_layouts,
    saved_per_layer,
)

QWEN3_0_6B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {  # the published config.json's sizes (Qwen/Qwen3-30B-A3B)
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def test_parameter_counts():
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    # block: q 1024·2048 + k, v 2·1024·1024 + o 2048·1024 + qk norms 2·128 + FFN 3·1024·3072
    # + two norms 2·1024 = 15,730,944; 28 blocks + embedding 151,936·1024 + final norm 1024
    assert small.block_params == 15_730_944
    assert small.params == 28 * 15_730_944 + 155_582_464 + 1024 == 596_049_920  # "0.6B"
    big = ModelDims.from_hf_config(QWEN3_8B)
    # q 4096² + k, v 2·4096·1024 + o 4096² + 256 + FFN 3·4096·12288 + 2·4096
    assert big.block_params == 192_946_432
    # 36 blocks + embedding and output 2·622,329,856 (untied) + final norm: "8.2B"
    assert big.params == 36 * 192_946_432 + 2 * 622_329_856 + 4096 == 8_190_735_360
    # the largest FSDP unit: tied, embedding + norm + output together; untied, norm + output
    assert small.largest_fsdp_unit == 155_582_464 + 1024
    assert big.largest_fsdp_unit == 622_329_856 + 4096


def test_moe_parameter_counts_total_active_and_experts():
    """Qwen3-30B-A3B by hand: "30.5B" parameters, "3.3B" active (Qwen's model card)."""
    m = ModelDims.from_hf_config(QWEN3_30B_A3B)
    assert (m.experts, m.top_k, m.moe_intermediate, m.moe_layers) == (128, 8, 768, 48)
    # q 2048·4096 + k, v 2·2048·512 + o 4096·2048 + qk norms 2·128 + two norms 2·2048
    assert m.attention_params == 18_878_720
    assert m.expert_params == 3 * 2048 * 768 == 4_718_592
    # + router 2048·128 + 128 experts
    assert m.moe_block_params == 18_878_720 + 262_144 + 128 * 4_718_592 == 623_120_640
    # 48 MoE blocks, embedding and output (untied) 2·311,164,928, final norm
    assert m.params == 48 * 623_120_640 + 2 * 311_164_928 + 2048 == 30_532_122_624
    # each token: 8 of the 128 experts
    assert m.active_params == m.params - 48 * 120 * 4_718_592 == 3_353_032_704
    assert m.experts_params == 48 * 128 * 4_718_592 == 28_991_029_248
    assert m.largest_fsdp_unit == 623_120_640  # a block with all its experts (no EP)
    dense = ModelDims.from_hf_config(QWEN3_8B)
    assert dense.active_params == dense.params and dense.experts_params == 0


def test_moe_counts_equal_a_real_checkpoints_tensors(tmp_path):
    """A tiny Qwen3-MoE written by transformers (tools/make_tiny_model.py), with a dense layer
    between MoE ones (``mlp_only_layers``): the plan's total is the checkpoint's element count,
    and its experts' the experts' tensors'."""
    import json

    from safetensors.torch import load_file

    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(
        tmp_path / "m",
        arch="qwen3_moe",
        layers=3,
        experts=4,
        dense_layers=(1,),
        tie_embeddings=False,
    )
    m = ModelDims.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert (m.moe_layers, m.dense_layers) == (2, 1)
    sd = load_file(str(folder / "model.safetensors"))
    assert m.params == sum(t.numel() for t in sd.values())
    assert m.experts_params == sum(t.numel() for k, t in sd.items() if ".experts." in k)


def test_moe_activations_count_top_k_experts_a_token():
    """An MoE block saves, per token, top_k experts' SwiGLU tensors instead of the dense width,
    plus the router's scores and the tokens' copies in expert order (an estimate)."""
    m = ModelDims.from_hf_config(QWEN3_30B_A3B)  # h 2048, q 4096, kv 512, k·I_e 8·768
    ki = 8 * 768
    assert saved_per_layer(m, "none", moe=True) == (
        4 * 2048 + 3 * 4096 + 3 * 512 + 4 * ki + 2 * 8 * 2048 + 128
    )
    assert saved_per_layer(m, "selective", moe=True) == (
        2 * 2048 + 2 * 4096 + 2 * 512 + ki + 8 * 2048 + 128
    )
    assert saved_per_layer(m, "full", moe=True) == 2048
    per_token = 48 * saved_per_layer(m, "full", moe=True) + saved_per_layer(m, "none", moe=True)
    assert activation_bytes_per_token(m, "full", 2) == 2 * (per_token + 2 * 2048)


def test_saved_activations_per_layer_and_token():
    big = ModelDims.from_hf_config(QWEN3_8B)  # h 4096, q 4096, kv 1024, I 12288
    assert saved_per_layer(big, "none") == 4 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 12288 == 80_896
    assert saved_per_layer(big, "selective") == 2 * 4096 + 2 * 4096 + 2 * 1024 + 12288 == 30_720
    assert saved_per_layer(big, "full") == 4096
    # tensor parallel over 2: the heads' and the FFN's tensors split, the hidden-sized ones whole
    assert saved_per_layer(big, "none", 2) == 4 * 4096 + (3 * 4096 + 3 * 1024 + 4 * 12288) // 2
    assert saved_per_layer(big, "selective", 2) == 2 * 4096 + (2 * 4096 + 2 * 1024 + 12288) // 2
    assert saved_per_layer(big, "full", 2) == 4096
    # bytes per token in bfloat16: 36 layers' saved tensors (+ one block recomputed in full with
    # checkpointing) + the final norm's input and output
    assert activation_bytes_per_token(big, "none", 2) == 2 * (36 * 80_896 + 2 * 4096) == 5_840_896
    assert activation_bytes_per_token(big, "selective", 2) == 2 * (36 * 30_720 + 80_896 + 8192)
    assert activation_bytes_per_token(big, "full", 2) == 2 * (36 * 4096 + 80_896 + 8192) == 473_088


def _plan_8b(checkpointing: str, *, rank0: bool = True):
    """recipes/multinode.yaml's learner: 16 ranks, bfloat16, 65,536-token micro-batches."""
    return learner_plan(
        ModelDims.from_hf_config(QWEN3_8B),
        ranks=16,
        compute_dtype="bfloat16",
        micro_batch_tokens=65_536,
        max_seq_len=8192,
        checkpointing=checkpointing,
        chunk_tokens=chunk_tokens(151_936, 256.0),
        rank0=rank0,
        weights_dtype="bfloat16",
    )


def test_qwen3_8b_on_16_ranks_rank_0():
    """recipes/multinode.yaml: 16 ranks, bfloat16, 65,536-token micro-batches, full checkpointing."""
    assert chunk_tokens(151_936, 256.0) == 110  # 256 MiB // (16 bytes × 151,936)
    plan = _plan_8b("full")
    shard = 8_190_735_360 // 16  # 511,920,960 parameters per rank
    assert plan.params == plan.grads == 4 * shard == 2_047_683_840
    assert plan.optimizer == 8 * shard == 4_095_367_680
    assert plan.reference == 0
    # three bfloat16 copies of the largest unit, and its float32 reduce-scatter input
    assert plan.fsdp_gather == (3 * 2 + 4) * 622_333_952 == 6_223_339_520
    assert plan.tokens == 65_536
    assert plan.activations == 65_536 * 473_088 == 31_004_295_168
    assert plan.logits == 110 * 151_936 * 16 == 267_407_360
    assert plan.weight_snapshot == 2 * 8_190_735_360 * 2 == 32_762_941_440  # overlap: two copies
    assert plan.total == 78_448_718_848  # 73.1 GiB: fits an 80 GB GPU
    other = _plan_8b("full", rank0=False)
    assert other.total == plan.total - plan.weight_snapshot
    assert plan.checkpoint_staging == 0  # a synchronous checkpoint stages nothing
    # without checkpointing the activations alone are 65,536 × 5,840,896 bytes (356.5 GiB)
    none = _plan_8b("none")
    assert none.activations == 382_788_960_256
    # everything but activations (what a smaller micro-batch cannot shrink):
    # 2·2,047,683,840 + 4,095,367,680 + 3,734,003,712 + 267,407,360 + 32,762,941,440 bytes
    assert none.fixed == 47_444_423_680


def test_qwen3_0_6b_on_4_ranks_with_a_reference_model_and_no_overlap():
    """recipes/qwen3_0.6b_gsm8k.yaml's learner, plus a KL reference and a synchronous broadcast."""
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    plan = learner_plan(
        small,
        ranks=4,
        compute_dtype="bfloat16",
        micro_batch_tokens=32_768,
        max_seq_len=4096,
        checkpointing="none",
        chunk_tokens=110,
        reference_model=True,
        weights_overlap=False,
    )
    shard = 596_049_920 // 4  # 149,012,480
    assert plan.params == plan.grads == plan.reference == 4 * shard == 596_049_920
    assert plan.optimizer == 1_192_099_840
    assert plan.fsdp_gather == (3 * 2 + 4) * 155_583_488 == 1_555_834_880
    # none: 4·1024 + 3·2048 + 3·1024 + 4·3072 = 25,600 per layer; (28·25,600 + 2·1024)·2 bytes
    assert plan.activation_bytes_per_token == 1_437_696
    assert plan.activations == 32_768 * 1_437_696 == 47_110_422_528
    assert plan.weight_snapshot == 596_049_920 * 2 == 1_192_099_840
    # params, grads, reference + AdamW, snapshot + gather + activations + logits chunk
    assert plan.total == 53_106_014_208  # 49.5 GiB


def test_a_critic_adds_its_params_grads_and_adamw_and_its_checkpoint_staging():
    """PPO with a critic (algorithm.advantage gae): the critic's float32 shards, 16·P/N, priced at
    the actor's size; an asynchronous checkpoint stages both models' parameters and AdamW."""
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    kw = dict(
        ranks=4,
        compute_dtype="bfloat16",
        micro_batch_tokens=32_768,
        max_seq_len=4096,
        checkpointing="none",
        chunk_tokens=110,
        checkpoint_async=True,
    )
    actor = learner_plan(small, **kw)
    both = learner_plan(small, critic_model=True, **kw)
    shard = 596_049_920 // 4
    assert actor.critic == 0 and both.critic == 16 * shard
    assert both.total - actor.total == 16 * shard
    assert ("critic", 16 * shard) in both.items() and "critic" not in dict(actor.items())
    assert both.checkpoint_staging == 2 * actor.checkpoint_staging == 24 * shard


def test_float32_learner_and_a_sequence_longer_than_the_micro_batch():
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    plan = learner_plan(
        small,
        ranks=1,
        compute_dtype="float32",
        micro_batch_tokens=1024,
        max_seq_len=4096,  # a 4,096-token sequence gets a micro-batch of its own
        checkpointing="full",
        chunk_tokens=110,
    )
    assert plan.tokens == 4096
    assert plan.params == 4 * 596_049_920
    assert plan.fsdp_gather == (3 * 4 + 4) * 155_583_488
    assert plan.activations == 4096 * 4 * (28 * 1024 + 25_600 + 2048)
    assert plan.weight_snapshot == 2 * 596_049_920 * 2  # the wire dtype: bfloat16


def test_generators():
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    # recipes/qwen3_0.6b_gsm8k.yaml: 256 groups of 8 over 4 servers = 512 sequences each
    seqs = in_flight_sequences(max_concurrent_groups=256, group_size=8, generators=4)
    assert seqs == 512
    sg = generator_plan(small, kind="sglang", dtype_bytes=2, sequences=seqs, seq_len=4096)
    assert sg.weights == 596_049_920 * 2
    assert small.kv_bytes_per_token(2) == 2 * 28 * 1024 * 2 == 114_688
    assert sg.kv_cache == 512 * 4096 * 114_688
    assert sg.staging == 0
    big = ModelDims.from_hf_config(QWEN3_8B)
    tp2 = generator_plan(big, kind="sglang", dtype_bytes=2, sequences=10, seq_len=8192, tp=2)
    assert tp2.weights == 8_190_735_360  # 16.4 GB of bfloat16 weights over 2 GPUs
    assert tp2.kv_cache == 10 * 8192 * (2 * 36 * 1024 * 2) // 2
    # the built-in engine (float32): 200 in flight, 128 running, slot rows 128 (a power of two);
    # the weights twice (a staged update)
    bi = generator_plan(
        small, kind="builtin", dtype_bytes=4, sequences=200, seq_len=64, max_batch_size=128
    )
    assert bi.weights == bi.staging == 596_049_920 * 4
    assert bi.sequences == 128
    assert bi.kv_cache == 128 * 64 * (2 * 28 * 1024 * 4)
    assert (
        generator_plan(small, kind="builtin", dtype_bytes=4, sequences=5, seq_len=64).sequences == 8
    )


def test_a_config_without_a_needed_key_is_one_line():
    cfg = dict(QWEN3_8B)
    del cfg["intermediate_size"]
    with pytest.raises(PlanError, match="'intermediate_size' must be a positive integer"):
        ModelDims.from_hf_config(cfg)


def test_a_small_batch_bounds_the_micro_batch_and_an_async_checkpoint_stages_on_the_host():
    """tools/bench/model_scale.py's Qwen3-0.6B run: 4 groups of 4 per step, one rank, 64 tokens."""
    plan = learner_plan(
        ModelDims.from_hf_config(QWEN3_0_6B),
        ranks=1,
        compute_dtype="float32",
        micro_batch_tokens=8192,
        max_seq_len=64,
        checkpointing="none",
        chunk_tokens=110,
        samples_per_update=16,
        checkpoint_async=True,
    )
    assert plan.tokens == 16 * 64  # not 8,192: the whole update is 16 sequences of at most 64
    assert plan.activations == 1024 * 4 * (28 * 25_600 + 2048)
    # float32 parameters and both AdamW moments copied to the host: 12 bytes × 596,049,920
    assert plan.checkpoint_staging == 7_152_599_040
    assert plan.total == sum(v for _, v in plan.items())  # staging is host memory, not in total


# ---- placement and reallocation (rank_plans) -----------------------------------------------------

P8B = 8_190_735_360
PPO_PHASES = [  # the learner's levels of PPO with a critic and a KL term (asyncrl graph)
    Phase(label="values, ref", roles=frozenset({"critic", "ref"})),
    Phase(
        label="train_actor, train_critic",
        roles=frozenset({"actor", "critic"}),
        trains=frozenset({"actor", "critic"}),
    ),
]
KW_8B = dict(
    compute_dtype="bfloat16",
    micro_batch_tokens=65_536,
    max_seq_len=8192,
    checkpointing="full",
    chunk_tokens=110,
)


def _layouts(**roles) -> list[RoleLayout]:
    return [RoleLayout(role=k, **v) for k, v in roles.items()]


def test_every_role_on_every_rank_is_the_learner_plan():
    """The default placement: rank 0's peak is :func:`learner_plan`'s total with the critic and the
    reference (all resident, the train phase's working set), the other ranks' without the snapshot."""
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    kw = dict(KW_8B, micro_batch_tokens=32_768, max_seq_len=4096, checkpointing="none")
    four = tuple(range(4))
    plans = rank_plans(
        small,
        _layouts(actor={"ranks": four}, critic={"ranks": four}, ref={"ranks": four}),
        PPO_PHASES,
        world=4,
        weights_overlap=False,
        **kw,
    )
    whole = learner_plan(
        small, ranks=4, reference_model=True, critic_model=True, weights_overlap=False, **kw
    )
    assert [p.peak for p in plans] == [whole.total] + [whole.total - whole.weight_snapshot] * 3
    assert plans[0].peak_phase == "train_actor, train_critic"
    assert all(p.peak == p.peak_without_offload for p in plans)
    assert plans[1].states == {
        "actor": 16 * 149_012_480,
        "critic": 16 * 149_012_480,
        "ref": 4 * 149_012_480,
    }


def test_disjoint_roles_each_rank_holds_its_own():
    """8 GPUs, Qwen3-8B: the actor (and its π_ref) FSDP over ranks 0-5, the critic over 6-7."""
    big = ModelDims.from_hf_config(QWEN3_8B)
    plans = rank_plans(
        big,
        _layouts(
            actor={"ranks": tuple(range(6))},
            critic={"ranks": (6, 7)},
            ref={"ranks": tuple(range(6))},
        ),
        PPO_PHASES,
        world=8,
        **KW_8B,
    )
    assert [p.roles for p in plans] == [("actor", "ref")] * 6 + [("critic",)] * 2
    six, two = math.ceil(P8B / 6), P8B // 2  # 1,365,122,560 and 4,095,367,680 parameters
    assert plans[1].states == {"actor": 16 * six, "ref": 4 * six}
    assert plans[6].states == {"critic": 16 * two}  # 65.5 GB: a quarter of the ranks, 3× a shard
    # the largest unit (norm + output projection): three bfloat16 copies, a float32 reduce input
    gather = (3 * 2 + 4) * 622_333_952
    activations = 65_536 * 473_088  # full checkpointing, 65,536 tokens
    logits = 110 * 151_936 * 16
    # rank 1: the ref's forward (gather + logits) and the actor's update (+ activations)
    assert plans[1].phases == {
        "values, ref": 20 * six + gather + logits,
        "train_actor, train_critic": 20 * six + gather + activations + logits,
    }
    # rank 6: the critic's forward and its update (no vocabulary chunk: a scalar head)
    assert plans[6].phases == {
        "values, ref": 16 * two + gather,
        "train_actor, train_critic": 16 * two + gather + activations,
    }
    assert plans[6].peak == 102_753_517_568  # 95.7 GiB: the critic's two ranks are the fullest
    assert plans[0].weight_snapshot == 2 * P8B * 2 and plans[0].peak == plans[1].peak + 2 * P8B * 2
    assert plans[7].weight_snapshot == 0


def test_tensor_parallel_divides_the_gather_the_heads_and_ffn_activations_and_the_data_over_dp():
    """The actor TP 2 × DP 4 on 8 ranks: states still 16·P/8 a rank; the gathered unit halved; of
    the activations only the heads' and the FFN's halved (sequence parallelism is off: the
    hidden-sized ones stay whole on each rank); an update's 32 sequences split over 4
    data-parallel groups, not 8."""
    big = ModelDims.from_hf_config(QWEN3_8B)
    kw = dict(KW_8B, samples_per_update=32)
    eight = tuple(range(8))
    fsdp = rank_plans(big, _layouts(actor={"ranks": eight}), PPO_PHASES[1:], world=8, **kw)
    tp = rank_plans(
        big, _layouts(actor={"ranks": eight, "tensor_parallel": 2}), PPO_PHASES[1:], world=8, **kw
    )
    assert tp[3].states == fsdp[3].states == {"actor": 16 * P8B // 8}
    lp1 = learner_plan(big, ranks=8, **kw)
    lp2 = learner_plan(big, ranks=8, tensor_parallel=2, **kw)
    assert lp1.tokens == 4 * 8192 and lp2.tokens == 8 * 8192  # 32/8 vs 32/4 sequences a rank
    assert lp2.fsdp_gather * 2 == lp1.fsdp_gather
    # full checkpointing: each of 36 blocks keeps its input (h, whole); the block recomputed keeps
    # 4h whole and 3q + 3kv + 4I over 2; the final norm's 2h whole; bfloat16
    h, q, kv, i = 4096, 4096, 1024, 12288
    assert lp1.activation_bytes_per_token == 2 * (36 * h + 4 * h + 3 * q + 3 * kv + 4 * i + 2 * h)
    split = (3 * q + 3 * kv + 4 * i) // 2
    assert lp2.activation_bytes_per_token == 2 * (36 * h + 4 * h + split + 2 * h) == 408_576
    assert lp2.activations == 8 * 8192 * 408_576  # twice the tokens, 0.86x the bytes per token
    assert tp[3].peak == fsdp[3].peak - lp1.fsdp_gather // 2 + lp2.activations - lp1.activations


def test_reallocation_counts_an_offloaded_roles_states_only_while_it_runs():
    """Every role on all 8 ranks, critic and ref offloaded: the ref's 4·P/8 leaves the update's
    peak; the critic's does not (its update runs inside the actor's train step, one level)."""
    big = ModelDims.from_hf_config(QWEN3_8B)
    eight = tuple(range(8))
    lay = _layouts(
        actor={"ranks": eight},
        critic={"ranks": eight, "offload": True},
        ref={"ranks": eight, "offload": True},
    )
    (_, rank1, *_) = rank_plans(big, lay, PPO_PHASES, world=8, **KW_8B)
    shard = P8B // 8
    lp = learner_plan(big, ranks=8, **KW_8B)
    assert rank1.phases["values, ref"] == (16 + 16 + 4) * shard + lp.fsdp_gather + lp.logits
    assert (
        rank1.phases["train_actor, train_critic"]
        == (16 + 16) * shard + lp.fsdp_gather + lp.activations + lp.logits
    )
    assert rank1.peak == rank1.phases["train_actor, train_critic"]
    assert rank1.peak_without_offload - rank1.peak == 4 * shard  # the ref's 4.1 GB


def test_lora_prices_the_adapters_and_their_training_state_only():
    """``learner.lora`` rank 16 on every target (PEFT's count for these models): the frozen base
    keeps its float32 shards; gradients, AdamW, the gradient buffers, the snapshot and the
    checkpoint are the adapters'."""
    small, big = ModelDims.from_hf_config(QWEN3_0_6B), ModelDims.from_hf_config(QWEN3_8B)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # r · (in + out) per target: q 1024+2048, k and v 1024+1024, o 2048+1024, FFN 3 × (1024+3072)
    assert small.lora_params(16, every) == 28 * 16 * (3072 + 2 * 2048 + 3072 + 3 * 4096)
    assert small.lora_params(16, every) == 10_092_544
    # q 4096+4096, k and v 4096+1024, o 4096+4096, FFN 3 × (4096+12288)
    adapters = big.lora_params(16, every)
    assert adapters == 36 * 16 * (8192 + 2 * 5120 + 8192 + 3 * 16384) == 43_646_976
    assert big.lora_params(16, ["q_proj", "v_proj"]) == 36 * 16 * (8192 + 5120)
    full = _plan_8b("full")
    plan = learner_plan(
        big,
        ranks=16,
        compute_dtype="bfloat16",
        micro_batch_tokens=65_536,
        max_seq_len=8192,
        checkpointing="full",
        chunk_tokens=chunk_tokens(151_936, 256.0),
        weights_dtype="bfloat16",
        checkpoint_async=True,
        lora_params=adapters,
    )
    a_shard = math.ceil(adapters / 16)  # 2,727,936
    assert plan.params == 4 * (8_190_735_360 // 16 + a_shard)
    assert plan.grads == 4 * a_shard and plan.optimizer == 8 * a_shard
    # two bfloat16 copies of the largest unit (the output projection: a block with its adapters
    # is smaller); a block's adapters' gradient, unsharded and in the float32 reduce-scatter input
    assert plan.fsdp_gather == 2 * 2 * 622_333_952 + (2 + 4) * adapters // 36
    assert plan.activations == full.activations and plan.logits == full.logits
    assert plan.weight_snapshot == 2 * adapters * 2  # overlap: two bfloat16 copies
    assert plan.checkpoint_staging == 3 * 4 * a_shard  # adapters and both moments
    # 8.2B on 16 ranks: 33.6 GiB a rank against 73.1 GiB for the whole model, the activations
    # (28.9 GiB) most of it; the snapshot alone was 30.5 GiB of the difference
    assert plan.total == sum(
        [2_058_595_584, 10_911_744, 21_823_488, 2_496_610_304, 31_004_295_168, 267_407_360]
        + [174_587_904]
    )
    assert full.total - plan.total > 39 * 2**30

    # with placement: the actor's states between calls are its base and 16 B per adapter parameter
    ranks = rank_plans(
        small,
        [RoleLayout(role="actor", ranks=(0, 1))],
        [Phase(label="train_actor", roles=frozenset({"actor"}), trains=frozenset({"actor"}))],
        world=2,
        compute_dtype="bfloat16",
        micro_batch_tokens=4096,
        max_seq_len=1024,
        checkpointing="none",
        chunk_tokens=110,
        lora_params=small.lora_params(16, every),
    )
    assert ranks[0].states["actor"] == math.ceil((4 * 596_049_920 + 16 * 10_092_544) / 2)
    assert ranks[0].weight_snapshot == 2 * 10_092_544 * 2 and ranks[1].weight_snapshot == 0


def test_lora_under_tensor_parallelism_prices_the_adapter_parts_it_replicates():
    """TP splits B of the column-parallel targets and A of the row-parallel ones and replicates
    the other factor, ``rank · hidden`` per target and layer: each of a TP group's ranks holds
    it whole, so a rank's adapter shard is ``(A + (t-1)·R)/N``; the snapshot is A's."""
    small = ModelDims.from_hf_config(QWEN3_0_6B)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    replicated = small.lora_tp_replicated(16, every)
    assert replicated == 28 * 16 * 1024 * 7 == 3_211_264
    adapters = small.lora_params(16, every)
    kw = dict(
        world=2,
        compute_dtype="bfloat16",
        micro_batch_tokens=4096,
        max_seq_len=1024,
        checkpointing="none",
        chunk_tokens=110,
        lora_params=adapters,
        lora_replicated=replicated,
    )
    train = [Phase(label="train_actor", roles=frozenset({"actor"}), trains=frozenset({"actor"}))]
    tp = rank_plans(small, [RoleLayout(role="actor", ranks=(0, 1), tensor_parallel=2)], train, **kw)
    held = adapters + replicated  # 13,303,808 over the group's two ranks
    assert tp[0].states["actor"] == math.ceil((4 * 596_049_920 + 16 * held) / 2)
    assert tp[0].weight_snapshot == 2 * adapters * 2
    fsdp = rank_plans(small, [RoleLayout(role="actor", ranks=(0, 1))], train, **kw)
    assert fsdp[0].states["actor"] == math.ceil((4 * 596_049_920 + 16 * adapters) / 2)
    plan = learner_plan(
        small, ranks=2, tensor_parallel=2, **{k: v for k, v in kw.items() if k != "world"}
    )
    assert plan.grads == 4 * math.ceil(held / 2) and plan.optimizer == 8 * math.ceil(held / 2)


def test_a_lora_actor_is_its_own_reference():
    """With adapters, a KL term's π_ref is the actor's frozen base: no model, no states of its own,
    unless it is placed apart from the actor (offloaded, other ranks)."""
    from asyncrl import recipe

    kl = {"algorithm": {"kl_coef": 0.1}, "learner": {"lora": {"rank": 8}}}
    assert [lay.role for lay in role_layouts(recipe.from_dict(kl))] == ["actor"]
    apart = kl | {"placement": {"ref": {"offload": True}}}
    assert [lay.role for lay in role_layouts(recipe.from_dict(apart))] == ["actor", "ref"]
    full = {"algorithm": {"kl_coef": 0.1}}
    assert [lay.role for lay in role_layouts(recipe.from_dict(full))] == ["actor", "ref"]
