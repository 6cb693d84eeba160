"""The built-in engine on a sequence-classification folder: SGLang's ``/classify``, the endpoint real
SGLang serves reward models on, so a rollout's model reward (:mod:`asyncrl.served.model_reward`)
talks to either.

Shape (SGLang 0.5.23, python/sglang/srt/entrypoints/http_server.py ``classify_request``, which takes
``EmbeddingReqInput`` and answers as ``/encode`` does): the body has ``text`` (a string or a list) or
``input_ids`` (a list of ids or a list of lists), optionally ``rid``; the answer is one item
``{"embedding": [score per label], "meta_info": {...}}``, or a list of them for a list input (SGLang's
``meta_info`` also has timing fields of its own; tests/sglang/test_classify.py compares). The
score is the head's output at the sequence's last token (SGLang's ``Pooler(LAST)``; a config with
``id2label`` is not L2-normalised).

No scheduler: a batch is one padded forward under a lock, in the HTTP thread that asked.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.engine.replies import BadRequest, Reply, is_int


def is_classifier(model_dir: str | Path) -> bool:
    """Is the HF folder a sequence-classification model (served by :class:`Classifier`)?"""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])


@dataclass
class Classifier:
    """A loaded ``*ForSequenceClassification`` model and its tokenizer, behind ``/classify``."""

    model_dir: str
    served_model_name: str | None = None
    weight_version: str = "default"
    max_batch_size: int = 64
    tokenizer: Any = None
    model: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    alive: bool = True  # what the engine's main loop watches (no decode thread here)

    @classmethod
    def load(cls, model_dir: str, **kw: Any) -> Classifier:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        c = cls(model_dir=model_dir, **kw)
        c.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        c.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
        c.model.requires_grad_(False).eval()
        return c

    def close(self) -> None:
        self.alive = False

    @property
    def context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    def routes(self) -> dict[str, Any]:
        return {
            "/classify": self.classify,
            "/health": lambda b: Reply(200, None),
            "/model_info": lambda b: Reply(200, self.model_info()),
            "/get_model_info": lambda b: Reply(200, self.model_info()),
        }

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "is_generation": False,
            "weight_version": self.weight_version,
            "served_model_name": self.served_model_name or self.model_dir,
        }

    # ---- /classify -------------------------------------------------------------------------------

    def _inputs(self, body: dict) -> tuple[list[list[int]], bool]:
        """(token ids per input, whether the request was a list)."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("give exactly one of text and input_ids")
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) and t for t in texts):
                raise BadRequest("text: expected a non-empty string or list of them")
            with self._lock:
                seqs = [list(self.tokenizer(t)["input_ids"]) for t in texts]
        else:
            batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            seqs = ids if batched else [ids]
            vocab = int(self.model.config.vocab_size)
            for i, s in enumerate(seqs):
                if not isinstance(s, list) or not s:
                    raise BadRequest(f"input_ids[{i}]: expected a non-empty list of token ids")
                if not all(is_int(t) and 0 <= t < vocab for t in s):
                    raise BadRequest(f"input_ids[{i}]: token ids must be integers in [0, {vocab})")
        for i, s in enumerate(seqs):
            if len(s) > self.context_length:
                raise BadRequest(
                    f"input {i} has {len(s)} tokens, over the context length {self.context_length}"
                )
        return seqs, batched

    def scores(self, seqs: list[list[int]]) -> torch.Tensor:
        """``[len(seqs), num_labels]``: the head at each sequence's last token (right-padded,
        causal: padding never reaches a real token, whatever the pad id)."""
        out = []
        for at in range(0, len(seqs), self.max_batch_size):
            part = seqs[at : at + self.max_batch_size]
            n, L = len(part), max(len(s) for s in part)
            ids = torch.zeros(n, L, dtype=torch.long)
            mask = torch.zeros(n, L, dtype=torch.long)
            for i, s in enumerate(part):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            with self._lock, torch.no_grad():
                h = self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                last = h[torch.arange(n), mask.sum(1) - 1]
                out.append(self.model.score(last).float())
        return torch.cat(out)

    def classify(self, body: dict) -> Reply:
        t0 = time.monotonic()
        seqs, batched = self._inputs(body)
        rids = _rids(body.get("rid"), len(seqs), batched)
        scores = self.scores(seqs).tolist()
        items = [
            {
                "embedding": s,
                "meta_info": {
                    "id": rids[i],
                    "finish_reason": {"type": "length", "length": 0},  # as SGLang's
                    "prompt_tokens": len(seqs[i]),
                    "weight_version": self.weight_version,
                    "num_retractions": 0,
                    "e2e_latency": time.monotonic() - t0,
                },
            }
            for i, s in enumerate(scores)
        ]
        return Reply(200, items if batched else items[0])


def _rids(rid: Any, n: int, batched: bool) -> list[str]:
    """Request ids as SGLang 0.5.23 gives them (io_struct ``_normalize_rid``): the caller's (a list,
    one each; or a string, suffixed ``_i`` in a batch), else fresh ones."""
    if isinstance(rid, list):
        if len(rid) != n:
            raise BadRequest(f"rid: {len(rid)} ids for {n} inputs")
        return [str(r) for r in rid]
    if rid:
        return [f"{rid}_{i}" for i in range(n)] if batched else [str(rid)]
    return [uuid.uuid4().hex for _ in range(n)]
