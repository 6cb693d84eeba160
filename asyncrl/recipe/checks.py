"""The checks across fields and on the file system that a recipe passes after each value's own
type and range (the loader's): one small named function per rule or section, which
:func:`validate` runs in the order of :data:`CHECKS`, so that the first error a recipe reports
does not depend on how the rules are filed. A check takes the recipe, the file it came from (for
the error) and whether to look at the file system; it returns nothing or raises
:class:`RecipeError`. :func:`warnings` lists what runs but is likely not meant.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from asyncrl.recipe import served
from asyncrl.recipe.fields import TOKEN_ADVANTAGES, RecipeError
from asyncrl.recipe.layout import check_critic_placement, check_placement, learner_roles
from asyncrl.recipe.moe_config import MOE_MODEL_TYPES, moe_layers
from asyncrl.recipe.schema import Recipe

Check = Callable[[Recipe, str | None, bool], None]
"""A named check: the recipe, its file (for the error), whether to look at the file system."""


def model_folder(r: Recipe, file: str | None, check_files: bool) -> None:
    """``model.path`` is an HF folder with a config.json."""
    if check_files and r.model.path and not r.resolve(r.model.path).is_dir():
        raise RecipeError(
            f"model folder {r.model.path!r} does not exist", file=file, key="model.path"
        )
    if check_files and r.model.path and not (r.resolve(r.model.path) / "config.json").is_file():
        raise RecipeError(
            f"model folder {r.model.path!r} has no config.json", file=file, key="model.path"
        )


def data_files(r: Recipe, file: str | None, check_files: bool) -> None:
    """``data.path`` and ``data.eval_path`` exist and are .jsonl, .json or .parquet."""
    for key in ("path", "eval_path"):
        p = getattr(r.data, key)
        if check_files and p and not r.resolve(p).is_file():
            raise RecipeError(f"data file {p!r} does not exist", file=file, key=f"data.{key}")
        if p and Path(p).suffix not in (".jsonl", ".json", ".parquet"):
            raise RecipeError(
                f"data file {p!r} must be .jsonl, .json or .parquet", file=file, key=f"data.{key}"
            )


def clip_low(r: Recipe, file: str | None, check_files: bool) -> None:
    if r.algorithm.clip_low >= 1:
        raise RecipeError("must be < 1", file=file, key="algorithm.clip_low")


def gspo_aggregation(r: Recipe, file: str | None, check_files: bool) -> None:
    alg = r.algorithm
    if alg.loss == "gspo" and alg.aggregation not in ("auto", "seq_mean_token_mean"):
        raise RecipeError(
            f"gspo is a sequence-level loss: it averages over sequences (seq_mean_token_mean); "
            f"got {alg.aggregation} (leave it auto)",
            file=file,
            key="algorithm.aggregation",
        )


def dual_clip(r: Recipe, file: str | None, check_files: bool) -> None:
    alg = r.algorithm
    if alg.dual_clip and alg.loss not in ("ppo", "decoupled_ppo"):
        raise RecipeError(
            f"the dual clip bounds a clipped ratio: ppo and decoupled_ppo only, not {alg.loss}",
            file=file,
            key="algorithm.dual_clip",
        )


def cispo_clip_low(r: Recipe, file: str | None, check_files: bool) -> None:
    alg = r.algorithm
    if alg.cispo_clip_low and alg.loss != "cispo":
        raise RecipeError(
            f"bounds cispo's weight from below: loss cispo only, not {alg.loss}",
            file=file,
            key="algorithm.cispo_clip_low",
        )


def vtrace_c_bar(r: Recipe, file: str | None, check_files: bool) -> None:
    alg = r.algorithm
    if alg.advantage == "vtrace" and alg.vtrace_c_bar > alg.vtrace_rho_bar:
        raise RecipeError(
            f"V-trace assumes c̄ ≤ ρ̄ (IMPALA), got {alg.vtrace_c_bar} > {alg.vtrace_rho_bar}",
            file=file,
            key="algorithm.vtrace_c_bar",
        )


def kl_reward(r: Recipe, file: str | None, check_files: bool) -> None:
    alg = r.algorithm
    if alg.kl_reward_coef > 0 and alg.advantage not in TOKEN_ADVANTAGES:
        raise RecipeError(
            f"a per-token KL reward needs a token-level advantage ({', '.join(TOKEN_ADVANTAGES)}); "
            f"{alg.advantage} sees one reward per sample (use algorithm.kl_coef)",
            file=file,
            key="algorithm.kl_reward_coef",
        )


def dynamic_sampling(r: Recipe, file: str | None, check_files: bool) -> None:
    """Dropping groups of equal rewards is for group baselines, not a critic's."""
    alg = r.algorithm
    if r.buffer.dynamic_sampling and alg.uses_rollouts and alg.advantage in TOKEN_ADVANTAGES:
        raise RecipeError(
            f"drops groups whose rewards are all equal, which carry no signal only under a group "
            f"baseline; under {alg.advantage} their A = R − V(x) ≠ 0 and they are states the critic "
            "must fit (dropping them by outcome biases both): set it false",
            file=file,
            key="buffer.dynamic_sampling",
        )


def rl_temperature(r: Recipe, file: str | None, check_files: bool) -> None:
    if r.algorithm.uses_rollouts and r.rollout.temperature == 0:
        raise RecipeError(
            "0 samples greedily, a policy whose probabilities are not the logprobs the generators "
            "report (log_softmax of the logits), so the importance ratios would be wrong and a "
            "group's samples alike: RL losses need > 0 (the held-out evaluation is greedy anyway)",
            file=file,
            key="rollout.temperature",
        )


def placement(r: Recipe, file: str | None, check_files: bool) -> None:
    """The learner's layout rules (:mod:`asyncrl.recipe.layout`), without the world size."""
    check_placement(r.placement, file=file)
    if "critic" in learner_roles(r):
        check_critic_placement(r.placement, file=file)


def turn_discount(r: Recipe, file: str | None, check_files: bool) -> None:
    if r.rollout.turn_discount != 1 and not r.rollout.turn_samples:
        raise RecipeError(
            "discounts the rewards of per-turn samples: set rollout.turn_samples: true",
            file=file,
            key="rollout.turn_discount",
        )


def betas(r: Recipe, file: str | None, check_files: bool) -> None:
    if len(r.learner.betas) != 2 or not all(0 <= b < 1 for b in r.learner.betas):
        raise RecipeError("expected two numbers in [0, 1)", file=file, key="learner.betas")


def sglang_urls(r: Recipe, file: str | None, check_files: bool) -> None:
    if r.generator.kind == "sglang" and not r.generator.urls and r.rollout.workers:
        raise RecipeError(
            "kind sglang needs at least one server URL", file=file, key="generator.urls"
        )


def nccl_to_cpu_engine(r: Recipe, file: str | None, check_files: bool) -> None:
    """A built-in engine on CPU receives each version into CPU tensors, which an NCCL group
    cannot fill: every version would fail. auto picks gloo for it."""
    g = r.generator
    if r.weights.backend == "nccl" and g.kind == "builtin" and g.device == "cpu":
        raise RecipeError(
            "nccl cannot send to a built-in engine on CPU (generator.device cpu: it receives "
            "into CPU tensors): set weights.backend=auto or gloo, or generator.device=cuda",
            file=file,
            key="weights.backend",
        )


def ratio_mask(r: Recipe, file: str | None, check_files: bool) -> None:
    if r.algorithm.ratio_mask_high and r.algorithm.ratio_mask_high <= r.algorithm.ratio_mask_low:
        raise RecipeError(
            "must be greater than algorithm.ratio_mask_low",
            file=file,
            key="algorithm.ratio_mask_high",
        )


def seq_mask(r: Recipe, file: str | None, check_files: bool) -> None:
    """The band must hold 1, every on-policy sequence's ratio (so low < high too)."""
    alg = r.algorithm
    if alg.seq_mask_low >= 1:
        raise RecipeError(
            f"must be < 1 (0: off), got {alg.seq_mask_low}: the band would drop on-policy "
            "sequences, whose geometric-mean ratio is 1",
            file=file,
            key="algorithm.seq_mask_low",
        )
    if alg.seq_mask_high and alg.seq_mask_high <= 1:
        raise RecipeError(
            f"must be > 1 (0: off), got {alg.seq_mask_high}: the band would drop on-policy "
            "sequences, whose geometric-mean ratio is 1",
            file=file,
            key="algorithm.seq_mask_high",
        )


def is_level(r: Recipe, file: str | None, check_files: bool) -> None:
    alg = r.algorithm
    if alg.is_level == "sequence" and alg.loss not in ("tis", "decoupled_ppo"):
        raise RecipeError(
            "a sequence-level weight replaces the truncated IS weight of tis and decoupled_ppo; "
            f"{alg.loss} has none (leave it token)",
            file=file,
            key="algorithm.is_level",
        )


def lr_ess(r: Recipe, file: str | None, check_files: bool) -> None:
    lc = r.learner
    if lc.lr_ess_floor and lc.lr_ess_scale == "off":
        raise RecipeError(
            "bounds the ESS scale of the lr from below: set learner.lr_ess_scale sqrt or linear",
            file=file,
            key="learner.lr_ess_floor",
        )


def reward_model_loss(r: Recipe, file: str | None, check_files: bool) -> None:
    """``algorithm.loss: reward_model``: one update per batch of pairs, no reference policy."""
    if r.algorithm.loss != "reward_model":
        return
    lc = r.learner
    if lc.minibatches != 1 or lc.epochs != 1:
        raise RecipeError(
            "reward_model makes one update per batch of pairs: leave minibatches and epochs 1",
            file=file,
            key="learner.minibatches" if lc.minibatches != 1 else "learner.epochs",
        )
    if r.algorithm.kl_coef:
        raise RecipeError(
            "reward_model has no reference policy: must be 0",
            file=file,
            key="algorithm.kl_coef",
        )


def check_lora(r: Recipe, file: str | None = None, check_files: bool = True) -> None:
    """What LoRA (``learner.lora``, docs/lora.md) cannot train right: adapter dropout under tensor
    parallelism (each TP rank would draw its own mask of the same replicated input) or in an RL
    loss (its ratios π/μ would measure the mask), a reward model (its score head and backbone
    train), repeated targets."""
    lo = r.learner.lora
    if not lo.enabled:
        return
    if lo.dropout and r.placement.actor.tensor_parallel > 1:
        raise RecipeError(
            f"{lo.dropout} with placement.actor.tensor_parallel "
            f"{r.placement.actor.tensor_parallel}: each tensor-parallel rank would draw its own "
            "dropout mask of the same input; set it 0 or tensor_parallel 1",
            file=file,
            key="learner.lora.dropout",
        )
    if lo.dropout and r.algorithm.uses_rollouts:
        raise RecipeError(
            f"{lo.dropout} with algorithm.loss {r.algorithm.loss}: dropout makes the learner's "
            "π differ from the sampler's μ on fresh data, so the ratios that clip, mask and "
            "weight tokens act on noise; set it 0 (it stays for sft)",
            file=file,
            key="learner.lora.dropout",
        )
    if r.algorithm.loss == "reward_model":
        raise RecipeError(
            "a reward model trains its backbone and score head, not adapters: set rank 0",
            file=file,
            key="learner.lora",
        )
    if not lo.targets or len(set(lo.targets)) != len(lo.targets):
        raise RecipeError(
            f"must name each HF linear layer once, got {lo.targets}",
            file=file,
            key="learner.lora.targets",
        )


def model_config(r: Recipe) -> dict | None:
    """``model.path``'s config.json (``{}`` when it is not a JSON object), or None when there is no
    path or the file cannot be read: the ``model_folder`` check reports a missing folder, the
    learner a bad config.json."""
    if not r.model.path:
        return None
    try:
        cfg = json.loads((r.resolve(r.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else {}


def moe_model(r: Recipe, file: str | None, check_files: bool) -> None:
    """What is not built for a mixture-of-experts policy (docs/moe.md): LoRA (its targets are the
    dense projections; the experts would train in full or not at all, untested either way), tensor
    parallelism (TorchTitan shards the experts' hidden dims, not run here), a critic or reward
    model (scalar heads on an MoE backbone, not run here). Needs the model's config.json, so only
    with ``check_files``."""
    cfg = model_config(r) if check_files else None
    mtype = None if cfg is None else cfg.get("model_type")
    if cfg is None or mtype not in MOE_MODEL_TYPES:
        return
    what = f"model.path is a mixture of experts (model_type {mtype})"
    if r.generator.kind == "sglang":
        sglang_moe_layout(cfg, what, file)
    if r.learner.lora.enabled:
        raise RecipeError(
            f"{what}: LoRA is not built for MoE models yet; set rank 0",
            file=file,
            key="learner.lora",
        )
    for role in learner_roles(r):
        tp = getattr(r.placement, role).tensor_parallel
        if tp > 1:
            raise RecipeError(
                f"{tp} with {what}: tensor parallelism of the experts is not run yet; set 1",
                file=file,
                key=f"placement.{role}.tensor_parallel",
            )
    if r.algorithm.loss == "reward_model" or "critic" in learner_roles(r):
        raise RecipeError(
            f"{r.algorithm.loss if r.algorithm.loss == 'reward_model' else r.algorithm.advantage} "
            f"with {what}: a scalar head on an MoE backbone (critic, reward model) is not built yet",
            file=file,
            key="algorithm.loss" if r.algorithm.loss == "reward_model" else "algorithm.advantage",
        )


def sglang_moe_layout(cfg: dict, what: str, file: str | None) -> None:
    """SGLang 0.5.23's Qwen3-MoE serves only Qwen's own layout: it always has an lm_head of its own
    (a tied checkpoint has none to load) and makes every layer an MoE one (a dense layer's MLP has
    no place, its router and experts none to load); it skips what it cannot place without an error
    and serves another model (docs/moe.md: uniform logits, other experts)."""
    wrong = []
    if cfg.get("tie_word_embeddings", False):
        wrong.append("tie_word_embeddings true (SGLang's lm_head would stay unloaded)")
    dense = [i for i, sparse in enumerate(moe_layers(cfg)) if not sparse]
    if dense:
        wrong.append(
            f"dense layers {dense} (mlp_only_layers, decoder_sparse_step: SGLang makes every layer "
            "an MoE one and leaves it unloaded)"
        )
    if wrong:
        raise RecipeError(
            f"{what} with {' and '.join(wrong)}: SGLang 0.5.23 would serve another model without "
            "an error (docs/moe.md); use an untied checkpoint with every layer MoE, or kind builtin",
            file=file,
            key="generator.kind",
        )


def routing_replay(r: Recipe, file: str | None, check_files: bool) -> None:
    """Routing replay needs routes: rollouts from generators that record them (an offline data
    set has none) of a mixture-of-experts model (a dense one has no router). The model's kind is
    read from its config.json, so that part only with ``check_files``."""
    if not r.algorithm.routing_replay:
        return
    if not r.algorithm.uses_rollouts:
        raise RecipeError(
            f"true with algorithm.loss {r.algorithm.loss}: its data set has no routes to replay",
            file=file,
            key="algorithm.routing_replay",
        )
    cfg = model_config(r) if check_files else None
    if cfg is None:
        return
    mtype = cfg.get("model_type")
    if mtype not in MOE_MODEL_TYPES:
        raise RecipeError(
            f"true, but model.path is not a mixture of experts (model_type {mtype}): a dense "
            "model has no routes to replay",
            file=file,
            key="algorithm.routing_replay",
        )


def moe_aux_loss(r: Recipe, file: str | None, check_files: bool) -> None:
    """The load-balancing loss balances a mixture of experts' routers: a dense model has none, and
    the learner would add nothing while the recipe says it balances. The model's kind is read from
    its config.json, so only with ``check_files``."""
    cfg = model_config(r) if check_files and r.algorithm.moe_aux_loss_coef > 0 else None
    if cfg is None:
        return
    mtype = cfg.get("model_type")
    if mtype not in MOE_MODEL_TYPES:
        raise RecipeError(
            f"{r.algorithm.moe_aux_loss_coef} > 0, but model.path is not a mixture of experts "
            f"(model_type {mtype}): a dense model has no router to balance",
            file=file,
            key="algorithm.moe_aux_loss_coef",
        )


def model_reward(r: Recipe, file: str | None, check_files: bool) -> None:
    """``rollout.reward: model`` needs a reward model; the evaluation's reward is a rule."""
    if r.rollout.reward == "model" and not r.rollout.reward_model.enabled:
        raise RecipeError(
            "reward model needs rollout.reward_model.urls or rollout.reward_model.path",
            file=file,
            key="rollout.reward",
        )
    if r.rollout.eval_reward == "model":
        raise RecipeError(
            "the held-out evaluation scores with the rollouts' reward when empty; name a rule here",
            file=file,
            key="rollout.eval_reward",
        )


def buffer_tls(r: Recipe, file: str | None, check_files: bool) -> None:
    """``buffer.tls``: cert, key and ca together, each an existing file."""
    tls = r.buffer.tls
    given = [bool(tls.cert), bool(tls.key), bool(tls.ca)]
    if any(given) and not all(given):
        raise RecipeError("cert, key and ca must be given together", file=file, key="buffer.tls")
    for k in ("cert", "key", "ca"):
        p = getattr(tls, k)
        if check_files and p and not r.resolve(p).is_file():
            raise RecipeError(f"file {p!r} does not exist", file=file, key=f"buffer.tls.{k}")


def buffer_addresses(r: Recipe, file: str | None, check_files: bool) -> None:
    """The buffer's two addresses: a known scheme, tls+tcp:// exactly when buffer.tls is set."""
    tls = r.buffer.tls
    for k in ("address", "pub_address"):
        a = getattr(r.buffer, k)
        if not a.startswith(("tcp://", "ipc://", "tls+tcp://", "inproc://")):
            raise RecipeError(
                f"expected tcp://, ipc:// or tls+tcp:// address, got {a!r}",
                file=file,
                key=f"buffer.{k}",
            )
        if a.startswith("tls+tcp://") and not tls.cert:
            raise RecipeError("a tls+tcp:// address needs buffer.tls", file=file, key=f"buffer.{k}")
        if a.startswith("tcp://") and tls.cert:
            raise RecipeError(
                "buffer.tls is set, so use tls+tcp:// (plain tcp:// would not encrypt)",
                file=file,
                key=f"buffer.{k}",
            )


CHECKS: tuple[Check, ...] = (
    model_folder,
    data_files,
    clip_low,
    gspo_aggregation,
    dual_clip,
    cispo_clip_low,
    vtrace_c_bar,
    kl_reward,
    dynamic_sampling,
    rl_temperature,
    placement,
    turn_discount,
    betas,
    sglang_urls,
    nccl_to_cpu_engine,
    ratio_mask,
    seq_mask,
    is_level,
    lr_ess,
    reward_model_loss,
    check_lora,
    moe_model,
    routing_replay,
    moe_aux_loss,
    model_reward,
    served.reward_model_servers,
    served.teacher_and_distill,
    served.distill_coef,
    served.distill_temperature,
    served.distill_dynamic_sampling,
    served.teacher_servers,
    served.teacher_tokenizer,
    buffer_tls,
    buffer_addresses,
)
"""Every check :func:`validate` runs, in its order: the first that fails is the error reported."""


def validate(recipe: Recipe, *, file: str | None = None, check_files: bool = True) -> None:
    """Checks across fields and on the file system (unless ``check_files`` is false)."""
    for check in CHECKS:
        check(recipe, file, check_files)


def warnings(recipe: Recipe) -> list[str]:
    """Settings that run but are likely not what the user meant: one line each, naming the key.
    `asyncrl check` prints them and the learner logs them at start."""
    out = []
    alg, ro = recipe.algorithm, recipe.rollout
    if alg.loss == "gspo" and max(alg.clip_low, alg.clip_high) > 1e-2:
        out.append(
            f"algorithm.clip_low/clip_high: gspo clips a sequence's mean ratio, which stays close to "
            f"1; a range of {max(alg.clip_low, alg.clip_high):g} rarely clips (the GSPO paper uses "
            "3e-4 / 4e-4)"
        )
    if alg.uses_rollouts and (ro.top_p < 1 or ro.top_k > 0 or ro.min_p > 0):
        out.append(
            "rollout.top_p/top_k/min_p: generators report μ before truncation (log_softmax of "
            "logits / temperature, as SGLang does), so importance ratios do not see the truncation"
        )
    if alg.prox_anchor == "staleness" and alg.loss != "decoupled_ppo":
        # a warning, not an error: the demo recipes set the anchor, and a user who takes one to
        # another loss (sft, tis, ...) should not have to unset it
        out.append(
            f"algorithm.prox_anchor: staleness anchors decoupled_ppo's π_prox; {alg.loss} has "
            "none and ignores it"
        )
    one_update = recipe.learner.minibatches * recipe.learner.epochs == 1
    if alg.loss == "decoupled_ppo" and one_update and alg.prox_anchor == "recompute":
        out.append(
            "algorithm.loss: decoupled_ppo with one update per batch (learner.minibatches × "
            "learner.epochs = 1) is tis: π_prox is the weights being updated, so its clip "
            "(clip_low/clip_high/dual_clip) never acts; set learner.minibatches > 1 for its trust "
            "region, algorithm.prox_anchor: staleness, or loss: tis"
        )
    lora = recipe.learner.lora
    if lora.enabled and recipe.generator.kind == "sglang":
        out.append(
            f"learner.lora: SGLang servers load each version's adapter by name from the run "
            f"folder's adapters/ (docs/lora_sync.md): launch them with --enable-lora "
            f"--max-lora-rank {lora.rank} --lora-target-modules {' '.join(lora.targets)}, where "
            "they can read that folder"
        )
    if alg.routing_replay and recipe.generator.kind == "sglang":
        out.append(
            "algorithm.routing_replay: the workers ask SGLang for every request's routed experts "
            "(docs/moe.md): launch the servers with --enable-return-routed-experts"
        )
    return out
