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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    prompt = tok.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
    p, t = tok.encode(prompt), tok.encode(ANSWER) + [tok.eos_token_id]
    ids = torch.tensor([p + t])
    labels = torch.tensor([[-100] * len(p) + t])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    extra = 10  # steps past the first exact greedy match: a margin for the engine's own kernels
    for _ in range(400):
        res = model(input_ids=ids, labels=labels)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        if (res.logits[0, len(p) - 1 : -1].argmax(-1) == torch.tensor(t)).all():
            extra -= 1
            if extra == 0:
                break
    else:
        raise AssertionError(f"the tiny model did not learn the tool call (loss {res.loss.item()})")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text((src / "generation_config.json").read_text())
    return out
