"""Shared fixtures: tiny HF model folders made locally (no hub), one thread per process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tools/
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before tests/sglang's hook, which puts the server killers last
def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` (a run, a torchrun of several ranks, a whole check: 15-230 s each)
    first. Two workers (pytest-xdist's worksteal) each take half of this order and steal the tail
    of the other's queue when idle, so the long tests start early and the short ones fill the gaps
    at the end; in collection order a 230 s test that started last kept one core busy alone."""
    items.sort(key=lambda it: it.get_closest_marker("slow") is None)  # stable: otherwise as found


def _make(tmp_path_factory, name: str, **kw) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(name), **kw)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A random Qwen3ForCausalLM (hidden 128, 2 layers, tied embeddings) with a char tokenizer."""
    return _make(tmp_path_factory, "tiny_qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_untied(tmp_path_factory) -> Path:
    return _make(tmp_path_factory, "tiny_qwen3_untied", arch="qwen3", tie_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """A random Qwen3MoeForCausalLM (hidden 128, 2 layers, 8 experts of width 64, top-2, tied
    embeddings) with the same char tokenizer."""
    return _make(tmp_path_factory, "tiny_qwen3_moe", arch="qwen3_moe")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random LlamaForCausalLM, untied embeddings."""
    return _make(tmp_path_factory, "tiny_llama", arch="llama", tie_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> Path:
    return _make(tmp_path_factory, "tiny_llama_tied", arch="llama", tie_embeddings=True)


@pytest.fixture(scope="session")
def rollout_engine(tiny_qwen3):
    """One built-in engine on tiny_qwen3, served from this process, shared by the rollout tests
    (which must not change its weights or leave it paused)."""
    from asyncrl.engine.api import EngineConfig
    from asyncrl.engine.server import serve

    srv = serve(EngineConfig(model=str(tiny_qwen3), max_batch_size=16))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory, tiny_qwen3) -> Path:
    """tiny_qwen3's backbone with a random one-label head (scores spread over a few units), as the
    reward-model learner exports it: a Qwen3ForSequenceClassification folder
    (asyncrl.learner.scalar_model)."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.scalar_model import write_seq_cls_config
    from asyncrl.learner.trainer import Trainer

    seed = tmp_path_factory.mktemp("tiny_reward_model_seed")
    torch.manual_seed(0)
    m = AutoModelForSequenceClassification.from_pretrained(tiny_qwen3, num_labels=1)
    torch.nn.init.normal_(m.score.weight, std=0.5)
    m.save_pretrained(seed, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_qwen3 / f).is_file():
            shutil.copy2(tiny_qwen3 / f, seed / f)
    write_seq_cls_config(seed)
    r = recipe_mod.from_dict({"model": {"path": str(seed)}, "algorithm": {"loss": "reward_model"}})
    work = tmp_path_factory.mktemp("tiny_reward_model_run")
    trainer = Trainer(TrainerConfig.from_recipe(r), run_dir=work, checkpointing=False)
    try:
        return trainer.export_hf(tmp_path_factory.mktemp("tiny_reward_model") / "export")
    finally:
        trainer.close()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """The demo's tiny model and a small sort data set (tools/make_demo.py), for end-to-end runs."""
    from tools.make_demo import make_demo

    return make_demo(tmp_path_factory.mktemp("demo"), train=2000, eval=64)


@pytest.fixture(scope="session")
def tiny_qwen3_chat(tmp_path_factory) -> Path:
    """tiny_qwen3 with Qwen3's tool-calling chat template and room for its long tools prompt."""
    return _make(
        tmp_path_factory, "tiny_qwen3_chat", arch="qwen3", chat_template="qwen3", max_positions=2048
    )


@pytest.fixture(scope="session")
def tool_caller_dir(tiny_qwen3_chat, tmp_path_factory) -> Path:
    """tiny_qwen3_chat fitted to answer tests/tool_caller.py's chat with a tool call (~10 s)."""
    from tests.tool_caller import fit_tool_caller

    return fit_tool_caller(tiny_qwen3_chat, tmp_path_factory.mktemp("tool_caller"))
