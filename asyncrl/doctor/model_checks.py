"""The doctor's checks of ``model.path``: the model the learner can build from its config.json
(its dims, which every later plan reads; LoRA's support for it), and the attention it will train
with on this device. Config only: no weights are read."""

from __future__ import annotations

from asyncrl import memory
from asyncrl.doctor.context import Check, Doctor
from asyncrl.memory import ModelDims


def check_model(d: Doctor) -> list[Check]:
    from asyncrl.learner.model_spec import ModelConfigError, build_spec, read_hf_config

    path = d.recipe.resolve(d.recipe.model.path)
    try:
        cfg = read_hf_config(path)
        d.dims = ModelDims.from_hf_config(cfg)
        spec = build_spec(path, attention="auto", max_seq_len=1)  # attention below
        if d.recipe.learner.lora.enabled:
            from asyncrl.learner.lora import check_supported

            check_supported(spec.name)
    except (ModelConfigError, memory.PlanError) as e:
        return [Check(name="model", ok=False, detail=str(e))]
    m = d.dims
    tied = "tied" if m.tied else "untied"
    return [
        Check(
            name="model",
            ok=True,
            detail=f"{m.arch}, {_count(m.params)} parameters{_active(m)} (hidden {m.hidden}, "
            f"{m.layers} layers, {m.heads}/{m.kv_heads} heads, vocabulary {m.vocab:,}, "
            f"{tied} embeddings{_experts(m)})",
        )
    ]


def _active(m: ModelDims) -> str:
    """An MoE's active parameters (a token's: ``top_k`` experts of each MoE layer), what its
    compute per token scales with; its memory scales with the total."""
    return f", {_count(m.active_params)} active" if m.moe_layers else ""


def _experts(m: ModelDims) -> str:
    if not m.moe_layers:
        return ""
    return (
        f"; {m.experts} experts of width {m.moe_intermediate}, top-{m.top_k}, in {m.moe_layers} "
        f"of {m.layers} layers: {_count(m.experts_params)} parameters in experts"
    )


def check_attention(d: Doctor) -> list[Check]:
    from asyncrl.learner import cpu_shims
    from asyncrl.learner.attention import choose_attention, module_importable
    from asyncrl.learner.model_spec import ModelConfigError, build_spec

    if d.dims is None:
        return [Check(name="attention", ok=False, detail="cannot tell without the model")]
    kind = d.recipe.model.attention
    on_cpu = cpu_shims.ON_CPU
    try:  # what the learner will refuse (flex or varlen on CPU, varlen without its kernels)
        build_spec(d.recipe.resolve(d.recipe.model.path), attention=kind, max_seq_len=1)
    except ModelConfigError as e:
        return [Check(name="attention", ok=False, detail=str(e))]
    cap = None if on_cpu or not d.device or not d.device.gpus else d.device.gpus[0][3]
    try:
        chosen, why = choose_attention(
            kind, on_cpu=on_cpu, capability=cap, importable=module_importable
        )
    except ValueError as e:
        return [Check(name="attention", ok=False, detail=str(e))]
    warning = float32_attention_warning(d, chosen, on_cpu=on_cpu)
    return [Check(name="attention", ok=True, detail=f"{chosen}: {why}{warning}")]


def float32_attention_warning(d: Doctor, chosen: str, *, on_cpu: bool) -> str:
    """A warning (not a failure: float32 trains, correctly) for ``model.dtype: float32`` on a GPU
    with grouped-query attention, the recipe default: SDPA's flash kernel takes only half precision
    and its memory-efficient one no ``enable_gqa``, so the per-document SDPA falls back to the math
    kernel, which builds each document's L×L scores (time, and memory the plan does not count)."""
    m = d.dims
    if on_cpu or d.recipe.model.dtype != "float32" or m is None or m.kv_heads >= m.heads:
        return ""
    if chosen not in ("sdpa", "varlen"):
        return ""
    return (
        f"; warning: model.dtype float32 on a GPU with grouped-query attention ({m.heads}/"
        f"{m.kv_heads} heads): SDPA falls back to its math kernel (L×L scores per document, "
        "not in the memory plan) and varlen needs half precision: set model.dtype=bfloat16"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
