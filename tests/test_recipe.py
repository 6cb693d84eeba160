"""The recipe schema: loading, overrides, and one-line errors naming the key and the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from asyncrl import recipe
from asyncrl.recipe import Recipe, RecipeError


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


GOOD = """\
run:
  name: t
  steps: 3
learner:
  lr: 2.0e-5
buffer:
  max_staleness: 2
"""


def test_load_reads_sections_and_keeps_defaults(tmp_path):
    r = recipe.load(_write(tmp_path, GOOD))
    assert isinstance(r, Recipe)
    assert (r.run.name, r.run.steps, r.learner.lr, r.buffer.max_staleness) == ("t", 3, 2e-5, 2)
    assert r.buffer.groups_per_batch == Recipe().buffer.groups_per_batch
    assert r.base_dir == str(tmp_path.resolve())
    assert r.resolve("x/y") == tmp_path.resolve() / "x/y"
    assert recipe.load(_write(tmp_path, "", "empty.yaml")) == Recipe(
        base_dir=str(tmp_path.resolve())
    )


def test_overrides_are_typed(tmp_path):
    r = recipe.load(
        _write(tmp_path, GOOD),
        ["learner.lr=1e-6", "run.steps=7", "buffer.dynamic_sampling=true", "run.name=other"],
    )
    assert r.learner.lr == 1e-6 and isinstance(r.learner.lr, float)
    assert r.run.steps == 7 and r.buffer.dynamic_sampling is True and r.run.name == "other"
    assert recipe.parse_override("learner.lr=1e-6") == (["learner", "lr"], 1e-6)
    r2 = recipe.load(_write(tmp_path, GOOD), ["learner.lr=3"])  # an int where a float goes
    assert r2.learner.lr == 3.0 and isinstance(r2.learner.lr, float)


@pytest.mark.parametrize(
    "text, overrides, key, needle",
    [
        ("learner:\n  lrr: 1e-5\n", [], "learner.lrr", "did you mean 'lr'"),
        ("lerner:\n  lr: 1e-5\n", [], "lerner", "did you mean 'learner'"),
        ("", ["buffer.max_stalenes=2"], "buffer.max_stalenes", "did you mean 'max_staleness'"),
        ("", ["bufer.max_staleness=2"], "bufer.max_staleness", "did you mean 'buffer'"),
        ("run:\n  steps: many\n", [], "run.steps", "expected an integer, got 'many'"),
        ("buffer:\n  dynamic_sampling: 1\n", [], "buffer.dynamic_sampling", "true or false"),
        ("run:\n  steps: -1\n", [], "run.steps", "must be >= 0"),
        ("rollout:\n  top_p: 1.5\n", [], "rollout.top_p", "must be <= 1"),
        ("model:\n  dtype: fp8\n", [], "model.dtype", "expected one of float32"),
        ("buffer:\n  address: http://x\n", [], "buffer.address", "tcp://"),
        ("learner: 3\n", [], "learner", "expected a mapping"),
        ("learner:\n  minibatches: 0\n", [], "learner.minibatches", "must be >= 1"),
        (
            "algorithm: {loss: gspo, aggregation: token_mean}\n",
            [],
            "algorithm.aggregation",
            "gspo is a sequence-level loss",
        ),
        ("algorithm: {loss: tis, dual_clip: true}\n", [], "algorithm.dual_clip", "not tis"),
        ("algorithm: {kl_estimator: k4}\n", [], "algorithm.kl_estimator", "one of k1, k2, k3"),
        ("algorithm: {lam: 1.5}\n", [], "algorithm.lam", "must be <= 1"),
        ("", ["algorithm.gamma=-0.1"], "algorithm.gamma", "must be >= 0"),
        ("algorithm: {vtrace_rho_bar: 0}\n", [], "algorithm.vtrace_rho_bar", "must be > 0"),
        ("algorithm: {value_clip: -1}\n", [], "algorithm.value_clip", "must be >= 0"),
        ("algorithm: {kl_reward_coef: -0.1}\n", [], "algorithm.kl_reward_coef", "must be >= 0"),
        (
            "algorithm: {advantage: vtrace, vtrace_c_bar: 2.0}\n",
            [],
            "algorithm.vtrace_c_bar",
            "c̄ ≤ ρ̄",
        ),
        (
            "algorithm: {advantage: grpo, kl_reward_coef: 0.1}\n",
            [],
            "algorithm.kl_reward_coef",
            "token-level advantage (gae, vtrace)",
        ),
        ("algorithm: {advantage: gea}\n", [], "algorithm.advantage", "did you mean 'gae'"),
        ("algorithm: {seq_mask_low: -0.1}\n", [], "algorithm.seq_mask_low", "must be >= 0"),
        ("algorithm: {seq_mask_high: -1}\n", [], "algorithm.seq_mask_high", "must be >= 0"),
        (  # low >= high: the band cannot hold 1, the ratio of every on-policy sequence
            "algorithm: {seq_mask_low: 1.2, seq_mask_high: 1.1}\n",
            [],
            "algorithm.seq_mask_low",
            "must be < 1",
        ),
        ("algorithm: {seq_mask_high: 0.9}\n", [], "algorithm.seq_mask_high", "must be > 1"),
        (
            "algorithm: {loss: ppo, is_level: sequence}\n",
            [],
            "algorithm.is_level",
            "tis and decoupled_ppo",
        ),
        ("algorithm: {is_level: geometric}\n", [], "algorithm.is_level", "one of token, sequence"),
        (
            "algorithm: {loss: reward_model}\nlearner: {minibatches: 2}\n",
            [],
            "learner.minibatches",
            "one update per batch of pairs",
        ),
        ("rollout: {reward: model}\n", [], "rollout.reward", "rollout.reward_model.urls or"),
        (  # the launcher's servers or the user's: one of the two
            "rollout: {reward_model: {urls: ['http://127.0.0.1:30001'], path: rm}}\n",
            ["rollout.reward_model.path=."],
            "rollout.reward_model.path",
            "not both",
        ),
        (
            "rollout: {reward: model, reward_model: {path: no_such_rm}}\n",
            [],
            "rollout.reward_model.path",
            "'no_such_rm' has no config.json",
        ),
        (
            "rollout: {reward_model: {path: ., servers: 0}}\n",
            [],
            "rollout.reward_model.servers",
            "must be >= 1",
        ),
        ("rollout: {eval_reward: model}\n", [], "rollout.eval_reward", "name a rule"),
        (
            "rollout: {reward_model: {urls: [localhost:30001]}}\n",
            [],
            "rollout.reward_model.urls[0]",
            "http(s)://",
        ),
        (
            "placement: {actor: {ranks: [0, 1]}, critic: {ranks: [1, 2]}}\n",
            [],
            "placement.critic.ranks",
            "shares ranks [1] with placement.actor but not all",
        ),
        (
            "placement: {actor: {ranks: [0, 1, 2], tensor_parallel: 2}}\n",
            [],
            "placement.actor.tensor_parallel",
            "3 rank(s) do not split into tensor-parallel groups of 2",
        ),
        ("placement: {critic: {ranks: [1, 1]}}\n", [], "placement.critic.ranks", "distinct"),
        (
            "placement: {actor: {ranks: [1]}, critic: {ranks: [0]}}\n",
            [],
            "placement.actor.ranks",
            "the actor's ranks must include it, got [1]",
        ),
        ("placement: {actor: {tp: 2}}\n", [], "placement.actor.tp", "unknown key"),
        (
            "rollout: {turn_discount: 0.9}\n",
            [],
            "rollout.turn_discount",
            "set rollout.turn_samples: true",
        ),
        (
            "rollout: {reward_model: {normalize: zscore}}\n",
            [],
            "rollout.reward_model.normalize",
            "running",
        ),
        (  # DAPO's rule is a group estimator's: with a critic an all-equal group has A = R - V
            "algorithm: {advantage: gae}\nbuffer: {dynamic_sampling: true}\n",
            [],
            "buffer.dynamic_sampling",
            "under gae their A = R − V(x) ≠ 0",
        ),
        (
            "buffer: {dynamic_sampling: true}\n",
            ["algorithm.advantage=vtrace"],
            "buffer.dynamic_sampling",
            "under vtrace",
        ),
        ("rollout: {temperature: 0}\n", [], "rollout.temperature", "RL losses need > 0"),
        (
            "algorithm: {cispo_clip_low: true}\n",
            [],
            "algorithm.cispo_clip_low",
            "loss cispo only, not decoupled_ppo",
        ),
        (  # a built-in engine on CPU receives into CPU tensors: an NCCL group fails every version
            "generator: {kind: builtin, device: cpu}\nweights: {backend: nccl}\n",
            [],
            "weights.backend",
            "set weights.backend=auto or gloo, or generator.device=cuda",
        ),
        ("generator: {device: gpu}\n", [], "generator.device", "expected one of"),
        # on-policy distillation: the advantage and its teacher go together
        ("algorithm: {advantage: distill}\n", [], "rollout.teacher", "needs a teacher"),
        (
            "rollout: {teacher: {urls: ['http://127.0.0.1:30002']}}\n",
            [],
            "rollout.teacher",
            "read by algorithm.advantage distill only, not grpo",
        ),
        (
            "algorithm: {advantage: distill, loss: sft}\nrollout: {teacher: {path: .}}\n",
            [],
            "rollout.teacher",
            "not distill with loss sft",
        ),
        (
            "algorithm: {distill_coef: 0.5}\n",
            [],
            "algorithm.distill_coef",
            "set algorithm.advantage",
        ),
        ("algorithm: {distill_coef: -1}\n", [], "algorithm.distill_coef", "must be >= 0"),
        (
            "algorithm: {advantage: distill}\nrollout: {teacher: {urls: [localhost:1]}}\n",
            [],
            "rollout.teacher.urls[0]",
            "http(s)://",
        ),
        (
            "algorithm: {advantage: distill}\n"
            "rollout: {teacher: {urls: ['http://127.0.0.1:1'], path: .}}\n",
            [],
            "rollout.teacher.path",
            "not both",
        ),
        (
            "algorithm: {advantage: distill}\nrollout: {teacher: {path: no_such_teacher}}\n",
            [],
            "rollout.teacher.path",
            "has no config.json",
        ),
        (
            "algorithm: {advantage: distill}\nrollout: {teacher: {urls: ['http://127.0.0.1:1']}}\n"
            "buffer: {dynamic_sampling: true}\n",
            [],
            "buffer.dynamic_sampling",
            "the distill advantage is the teacher's",
        ),
    ],
)
def test_errors_name_key_and_file(tmp_path, text, overrides, key, needle):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        recipe.load(path, overrides)
    msg = str(e.value)
    assert key in msg and needle in msg
    assert "\n" not in msg
    assert e.value.key == key
    assert str(path) in msg or e.value.file == "override"


def test_what_the_refusals_of_a_critic_with_dynamic_sampling_and_of_greedy_rl_leave_alone(
    tmp_path,
):
    """Dynamic sampling stays a group estimator's setting, and temperature 0 stays possible where
    nothing is trained on rollouts (sft, reward_model: the learner reads no behaviour logprob)."""
    path = _write(tmp_path, GOOD + "rollout: {temperature: 0}\n")
    for loss in ("sft", "reward_model"):
        assert recipe.load(path, [f"algorithm.loss={loss}"]).rollout.temperature == 0
    path = _write(tmp_path, GOOD + "buffer: {dynamic_sampling: true}\n")
    for adv in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "remax"):
        assert recipe.load(path, [f"algorithm.advantage={adv}"]).buffer.dynamic_sampling
    gae = recipe.load(path, ["algorithm.advantage=gae", "buffer.dynamic_sampling=false"])
    assert not gae.buffer.dynamic_sampling


def test_nccl_is_refused_only_with_a_built_in_engine_on_cpu():
    """The refusal leaves the set-ups that work alone: NCCL to SGLang servers and to built-in
    engines on CUDA (generator.device cuda, or auto on a GPU host: they receive into CUDA
    tensors), and auto or gloo with a built-in engine on CPU (auto picks gloo for it:
    asyncrl.gpu.weight_backend)."""
    sglang = {"kind": "sglang", "urls": ["http://127.0.0.1:30000"]}
    recipe.from_dict({"generator": sglang, "weights": {"backend": "nccl"}})
    for device in ("auto", "cuda"):
        r = recipe.from_dict(
            {"generator": {"kind": "builtin", "device": device}, "weights": {"backend": "nccl"}}
        )
        assert r.generator.device == device
    for backend in ("auto", "gloo"):
        g = {"kind": "builtin", "device": "cpu"}
        recipe.from_dict({"generator": g, "weights": {"backend": backend}})
    assert recipe.from_dict({}).generator.device == "auto"  # the GPU when there is one


def test_tls_certificates_need_tls_addresses(tmp_path):
    text = "buffer:\n  address: tls+tcp://h:1\n  tls: {cert: c.pem, key: k.pem, ca: ca.pem}\n"
    with pytest.raises(RecipeError, match="buffer.pub_address: buffer.tls is set, so use tls"):
        recipe.load(_write(tmp_path, text), check_files=False)
    ok = recipe.load(
        _write(tmp_path, text), ["buffer.pub_address=tls+tcp://h:2"], check_files=False
    )
    assert ok.buffer.tls.ca == "ca.pem"


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found") as e:
        recipe.load(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(e.value)
    with pytest.raises(RecipeError, match="not valid YAML at line 2"):
        recipe.load(_write(tmp_path, "run:\n  name: a: b\n"))
    with pytest.raises(RecipeError, match="model.path: model folder 'nowhere' does not exist"):
        recipe.load(_write(tmp_path, "model:\n  path: nowhere\n"))
    r = recipe.load(_write(tmp_path, "model:\n  path: nowhere\n"), check_files=False)
    assert r.model.path == "nowhere"


def _check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "check", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_check_cli_one_line_error_for_a_misspelt_key(tmp_path):
    path = _write(tmp_path, "learner:\n  lrr: 1e-5\n")
    p = _check(str(path))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert str(path) in lines[0] and "learner.lrr" in lines[0] and "did you mean 'lr'" in lines[0]
    assert p.stdout == ""


def test_check_cli_prints_the_resolved_recipe(tmp_path):
    path = _write(tmp_path, GOOD)
    p = _check(str(path), "learner.lr=1e-6")
    assert p.returncode == 0, p.stderr
    printed = yaml.safe_load(p.stdout)
    assert printed["learner"]["lr"] == 1e-6
    assert printed["run"]["name"] == "t"
    assert set(printed) == {f for f in Recipe().to_dict()}


def test_check_cli_warns_of_settings_that_run_but_mislead(tmp_path):
    path = _write(tmp_path, GOOD + "algorithm: {loss: gspo}\nrollout: {top_p: 0.9}\n")
    p = _check(str(path))
    assert p.returncode == 0, p.stderr
    warnings = [ln for ln in p.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 2
    assert "clip_low/clip_high" in warnings[0] and "3e-4" in warnings[0]
    assert "top_p/top_k/min_p" in warnings[1] and "before truncation" in warnings[1]
    r = recipe.load(path)
    assert r.algorithm.aggregation_used == "seq_mean_token_mean"  # auto, for gspo
    quiet = recipe.load(
        path, ["algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4", "rollout.top_p=1"]
    )
    assert recipe.warnings(quiet) == []


def test_auto_aggregation_follows_the_loss_and_the_advantage(tmp_path):
    """auto: gspo's mean over sequences (its definition), Dr. GRPO's constant-length sum for
    dr_grpo (its second bias fix, without which its advantage is GRPO's without the std), else the
    token mean. An explicit aggregation is kept."""
    want = {
        ("tis", "dr_grpo"): "seq_mean_token_sum_norm",
        ("decoupled_ppo", "dr_grpo"): "seq_mean_token_sum_norm",
        ("gspo", "dr_grpo"): "seq_mean_token_mean",
        ("gspo", "grpo"): "seq_mean_token_mean",
        ("tis", "grpo"): "token_mean",
        ("ppo", "gae"): "token_mean",
    }
    for (loss, adv), agg in want.items():
        over = [f"algorithm.loss={loss}", f"algorithm.advantage={adv}"]
        assert recipe.load(_write(tmp_path, GOOD), over).algorithm.aggregation_used == agg
    over = ["algorithm.advantage=dr_grpo", "algorithm.aggregation=token_mean"]
    assert recipe.load(_write(tmp_path, GOOD), over).algorithm.aggregation_used == "token_mean"


def test_sequence_corrections_default_off_and_load(tmp_path):
    alg = recipe.load(_write(tmp_path, GOOD)).algorithm
    assert (alg.seq_mask_low, alg.seq_mask_high, alg.is_level) == (0.0, 0.0, "token")
    over = ["algorithm.loss=tis", "algorithm.is_level=sequence", "algorithm.seq_mask_low=0.5"]
    alg = recipe.load(_write(tmp_path, GOOD), over + ["algorithm.seq_mask_high=2"]).algorithm
    assert (alg.seq_mask_low, alg.seq_mask_high, alg.is_level) == (0.5, 2.0, "sequence")


def test_check_warns_that_decoupled_ppo_with_one_update_per_batch_is_tis(tmp_path):
    """π_prox = π with one update per batch: decoupled_ppo's clip never acts (docs/off-policy.md)."""
    path = _write(tmp_path, GOOD + "algorithm: {loss: decoupled_ppo}\n")
    p = _check(str(path))
    assert p.returncode == 0, p.stderr
    warnings = [ln for ln in p.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1, p.stderr
    assert "algorithm.loss: decoupled_ppo with one update per batch" in warnings[0]
    assert "is tis" in warnings[0] and "learner.minibatches > 1" in warnings[0]
    fixes = ("learner.minibatches=2", "learner.epochs=2", "algorithm.loss=tis")
    for fix in (*fixes, "algorithm.prox_anchor=staleness"):  # the anchor's clip acts at one update
        assert recipe.warnings(recipe.load(path, [fix])) == [], fix


def test_critic_fields_defaults(tmp_path):
    r = recipe.load(_write(tmp_path, GOOD))
    alg = r.algorithm
    assert (alg.gamma, alg.lam, alg.vtrace_rho_bar, alg.vtrace_c_bar) == (1.0, 1.0, 1.0, 1.0)
    assert (alg.value_clip, alg.kl_reward_coef) == (0.2, 0.0)
    assert (r.critic.path, r.critic.lr) == ("", 1e-5)
    updates = "learner.minibatches=2"  # decoupled_ppo (the default) with one update is warned of
    for adv in ("gae", "vtrace"):  # wired in the learner (learner/critic.py): nothing to warn of
        r = recipe.load(_write(tmp_path, GOOD), [f"algorithm.advantage={adv}", updates])
        assert recipe.warnings(r) == []
    # remax is wired: the worker plays the greedy episode, the learner subtracts its reward
    r = recipe.load(_write(tmp_path, GOOD), ["algorithm.advantage=remax", updates])
    assert recipe.warnings(r) == []
    r = recipe.load(
        _write(tmp_path, GOOD), ["algorithm.advantage=gae", "algorithm.kl_reward_coef=0.05"]
    )
    assert r.algorithm.kl_reward_coef == 0.05


def test_placement_against_the_learners_world():
    """The rank checks that need the world size run in the learner, with the same one-line errors;
    the ref follows the actor's ranks unless placed."""
    p = recipe.PlacementConfig(
        actor=recipe.RolePlacement(ranks=[0]), critic=recipe.RolePlacement(ranks=[1])
    )
    recipe.check_placement(p, world=2)
    assert p.ranks_of("ref", 2) == [0] and p.ranks_of("critic", 2) == [1]
    with pytest.raises(RecipeError, match=r"placement.critic.ranks: the learner has 1 rank"):
        recipe.check_placement(p, world=1)
    # the critic on every rank of 2 meets the actor's [0] without equalling it
    p.critic.ranks = []
    with pytest.raises(RecipeError, match="placement.critic.ranks: shares ranks"):
        recipe.check_placement(p, world=2)


def test_a_teacher_whose_tokenizer_is_not_the_students_is_refused(tmp_path, tiny_qwen3):
    """The teacher scores the student's token ids: its tokenizer must be the student's. The same
    folder (or a copy) passes; another vocabulary, or a tokenizer file only one side has, is
    refused naming rollout.teacher.path and what differs."""
    import json
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_qwen3, teacher)
    text = (
        f"model: {{path: {tiny_qwen3}}}\nalgorithm: {{advantage: distill}}\n"
        f"rollout: {{teacher: {{path: {teacher}}}}}\n"
    )
    path = _write(tmp_path, text)
    assert recipe.load(path).rollout.teacher.path == str(teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, other meanings
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(RecipeError) as e:
        recipe.load(path)
    assert e.value.key == "rollout.teacher.path" and "tokenizer.json differs" in str(e.value)
    (teacher / "tokenizer.json").unlink()
    with pytest.raises(RecipeError, match="tokenizer.json in one folder only"):
        recipe.load(path)
    assert recipe.load(path, check_files=False).rollout.teacher.path == str(teacher)


def test_distill_at_a_temperature_other_than_1_is_refused():
    """Issue #43 item 3: the teacher's logprobs are untempered (SGLang's input logprobs), the
    student's tempered. Worked example: student and teacher identical, logits [2, 0], T = 0.7.
    The student samples log_softmax([2, 0] / 0.7) = [−0.056, −2.913], the teacher says
    log_softmax([2, 0]) = [−0.127, −2.127]: A = [−0.071, +0.786] although they are the same model,
    and the logged reverse KL stays at 0.0245 nats per token (the student would converge to 0.7×
    the teacher's logits). One token's logprob cannot be re-tempered (its normaliser needs the whole
    vocabulary), so `asyncrl check` refuses T ≠ 1 with the distill advantage."""
    from asyncrl.learner.distill import distill

    z, t = torch.tensor([2.0, 0.0], dtype=torch.float64), 0.7
    student, teacher = torch.log_softmax(z / t, -1), torch.log_softmax(z, -1)
    a = distill(student[None], teacher[None], torch.ones(1, 2))[0]
    torch.testing.assert_close(
        a, torch.tensor([-0.071, 0.786], dtype=torch.float64), atol=1e-3, rtol=0
    )
    kl = float((student.exp() * (student - teacher)).sum())
    assert kl == pytest.approx(0.0245, abs=1e-4)
    teacher_urls = {"teacher": {"urls": ["http://127.0.0.1:1"]}}
    at = {"algorithm": {"advantage": "distill"}}
    assert recipe.from_dict(at | {"rollout": teacher_urls | {"temperature": 1.0}})
    with pytest.raises(
        RecipeError, match=r"^rollout\.temperature: 0\.7 with algorithm\.advantage distill"
    ):
        recipe.from_dict(at | {"rollout": teacher_urls | {"temperature": t}})
    # the other advantages keep any temperature
    assert recipe.from_dict({"rollout": {"temperature": t}}).rollout.temperature == t


def test_lora_combinations_that_cannot_train_are_one_line_errors():
    on = {"learner": {"lora": {"rank": 8}}}
    assert recipe.from_dict(on).learner.lora.scaling == 2.0
    # adapters under tensor parallelism train (tests/learner/test_lora.py), their dropout does not
    tp = on | {"placement": {"actor": {"tensor_parallel": 2}}}
    assert recipe.from_dict(tp).placement.actor.tensor_parallel == 2
    drop = tp | {"learner": {"lora": {"rank": 8, "dropout": 0.05}}}
    with pytest.raises(RecipeError, match=r"^learner\.lora\.dropout: 0\.05 with placement\.actor"):
        recipe.from_dict(drop)
    sft = {"algorithm": {"loss": "sft"}}
    assert recipe.from_dict(on | sft | {"learner": {"lora": {"rank": 8, "dropout": 0.05}}})
    # issue #43 item 4: in an RL loss dropout makes π/μ ≠ 1 on fresh data (the clip, the masks and
    # the IS weights would act on the dropout's noise): refused with every loss but sft
    for loss in ("decoupled_ppo", "tis", "cispo"):
        rl = {"algorithm": {"loss": loss}, "learner": {"lora": {"rank": 8, "dropout": 0.05}}}
        with pytest.raises(
            RecipeError,
            match=rf"^learner\.lora\.dropout: 0\.05 with algorithm\.loss {loss}: dropout makes",
        ):
            recipe.from_dict(rl)
    rm = on | {"algorithm": {"loss": "reward_model"}}
    with pytest.raises(RecipeError, match=r"^learner\.lora: a reward model trains"):
        recipe.from_dict(rm, check_files=False)
    twice = {"learner": {"lora": {"rank": 8, "targets": ["q_proj", "q_proj"]}}}
    with pytest.raises(RecipeError, match=r"^learner\.lora\.targets: must name each"):
        recipe.from_dict(twice)


def test_check_tells_how_to_launch_sglang_for_lora(tmp_path):
    """SGLang loads LoRA versions by name (docs/lora_sync.md): its launch must enable LoRA."""
    path = _write(tmp_path, GOOD)
    over = ["learner.minibatches=2", "learner.lora.rank=8", "learner.lora.targets=[q_proj,v_proj]"]
    assert recipe.warnings(recipe.load(path, over)) == []  # the built-in engine: nothing to do
    sglang = ["generator.kind=sglang", "generator.urls=[http://127.0.0.1:30000]"]
    (w,) = recipe.warnings(recipe.load(path, [*over, *sglang]))
    assert w.startswith("learner.lora: SGLang servers load each version's adapter by name")
    assert "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj" in w


def test_check_tells_how_to_launch_sglang_for_routing_replay(tmp_path):
    """SGLang returns routes only when launched for it (docs/moe.md)."""
    from tools.make_tiny_model import make_tiny_model

    # untied: SGLang 0.5.23 serves a tied Qwen3-MoE as another model, which check refuses
    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", tie_embeddings=False)
    path = _write(tmp_path, GOOD)
    over = [
        f"model.path={moe}",
        "algorithm.routing_replay=true",
        "learner.minibatches=2",
    ]
    assert recipe.warnings(recipe.load(path, over)) == []  # the built-in engine: nothing to do
    sglang = ["generator.kind=sglang", "generator.urls=[http://127.0.0.1:30000]"]
    (w,) = recipe.warnings(recipe.load(path, [*over, *sglang]))
    assert w.startswith("algorithm.routing_replay: the workers ask SGLang")
    assert w.endswith("launch the servers with --enable-return-routed-experts")
