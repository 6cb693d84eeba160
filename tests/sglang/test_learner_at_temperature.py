"""The learner's log π of tokens real SGLang sampled equals SGLang's own behaviour logprobs at the
sampling temperature: SGLang reports log_softmax(logits / T), and so must the learner, or every
importance ratio is off (~0.5 nat at T = 0.7 before the learner divided by T)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang_helpers import PROMPT, TOL, Served, generate, served_model_dir

from asyncrl import recipe as recipe_mod
from asyncrl.learner.packing import make_sequence, pack
from asyncrl.rollout.sglang_protocol import SamplingParams

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_learner_logprobs_equal_sglangs_at_the_temperature(served: Served, tmp_path, temperature):
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    params = SamplingParams(max_new_tokens=32, temperature=temperature, ignore_eos=True)
    c = generate(served.url, params)
    assert len(c.output_ids) == 32
    model = served_model_dir(served, tmp_path / "model")
    recipe = recipe_mod.from_dict(
        {
            "model": {"path": str(model), "max_seq_len": 128},
            "rollout": {"temperature": temperature},
            "run": {"output_dir": str(tmp_path / "runs")},
        }
    )
    trainer = Trainer(TrainerConfig.from_recipe(recipe), checkpointing=False)
    try:
        seq = make_sequence(0, np.array(PROMPT), np.array(c.output_ids))
        (learner,) = trainer.logprobs([pack([seq])])
    finally:
        trainer.close()
    err = (learner.double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
    assert err <= TOL, f"max |learner - SGLang| logprob {err:.2e} at T = {temperature}"
