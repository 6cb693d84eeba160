"""A tiny Qwen3 fitted to make one tool call: the chat, its tools and the answer it learns.

Shared by the engine's chat tests and the real-SGLang tier (both serve the fitted folder)."""

from __future__ import annotations

from pathlib import Path

import torch

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CHAT = [{"role": "user", "content": "What is 2+3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "Adding.\n" + CALL  # what the fitted model writes for CHAT with TOOLS, then <eos>


def fit_tool_caller(src: Path, out: Path, tools: list[dict] = TOOLS) -> Path:
    """``src`` fitted to answer CHAT (with ``tools``) with ANSWER under greedy decoding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    prompt = tok.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
    target = tok.encode(ANSWER) + [tok.eos_token_id]
    return fit_greedy(src, [(tok.encode(prompt), target)], out, steps=400)


MARGIN = 1.0
"""How far the target token's logit must lead every other one, at every target position, in the
weights that are saved. Greedy decoding elsewhere (the built-in engine's KV-cache kernels, SGLang,
another CPU's kernels) computes those logits to ~1e-5 (tests/numerics.py: LOGPROB_ATOL), so a lead
of 1 cannot flip; a fit stopped at its first exact argmax can lead by ~1e-3, and one more Adam step
can undo it (the fit once saved weights it had not checked, and an AVX2-less kernel path decoded
them otherwise)."""


def greedy_margin(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """min over target positions of (the target's logit − the largest other logit): > 0 iff greedy
    decoding under teacher forcing gives every target token."""
    mask = labels[:, 1:] != -100
    lg, tgt = logits[:, :-1][mask], labels[:, 1:][mask]
    top = lg.gather(1, tgt[:, None])[:, 0]
    other = lg.scatter(1, tgt[:, None], float("-inf")).max(1).values
    return float((top - other).min())


def fit_greedy(
    src: Path, rows: list[tuple[list[int], list[int]]], out: Path, *, steps: int
) -> Path:
    """``src`` fitted until greedy decoding of each row's prompt gives exactly its target, every
    target token ahead by :data:`MARGIN`, checked on the weights that are saved to ``out`` with
    its tokenizer. Rows: (prompt ids, target ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n = max(len(p) + len(t) for p, t in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        res = model(input_ids=ids, labels=labels)
        if greedy_margin(res.logits.detach(), labels) >= MARGIN:
            break  # these weights, the ones just checked, are saved
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    else:
        raise AssertionError(
            f"the tiny model did not learn its targets by a margin of {MARGIN} in {steps} steps "
            f"(loss {res.loss.item()}, margin {greedy_margin(res.logits.detach(), labels)})"
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    (out / "generation_config.json").write_text((src / "generation_config.json").read_text())
    return out
