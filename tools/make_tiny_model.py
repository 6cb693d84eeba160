"""Make a tiny HuggingFace causal LM folder locally (no download): config, safetensors, tokenizer.

The tokenizer is character-level over printable ASCII, so every synthetic task, tool call and chat
template can be written in plain text. Used by the tests, the benches and the CPU demo.

    python tools/make_tiny_model.py OUT_DIR [--arch qwen3|llama|qwen3_moe] [--hidden 128] [--layers 2]
        [--untied] [--experts 8 --top-k 2 --moe-intermediate 64]
    python tools/make_tiny_model.py OUT_DIR --flavour qwen3-0.6b   # real sizes, random weights
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Qwen3's chat template (its Hugging Face tokenizer_config.json), the parts that do tools: the
# "# Tools" system block listing the schemas in <tools>, assistant tool calls written as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, tool results as <tool_response> in a
# user turn. Left out: the <think> history handling. With the char tokenizer its markers are plain
# text, so a tiny model sees the same prompts SGLang's Qwen tool parser expects.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHAT_TEMPLATES = {"plain": CHAT_TEMPLATE, "qwen3": QWEN3_CHAT_TEMPLATE}


FLAVOURS = {
    # Qwen3-0.6B's config.json (hidden 1024, 28 layers, vocabulary 151,936, tied embeddings),
    # random weights: real sizes for memory and speed, built here without a download.
    "qwen3-0.6b": dict(
        arch="qwen3",
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=3072,
        vocab_size=151_936,
        max_positions=40_960,
        rope_theta=1_000_000.0,
        tie_embeddings=True,
    ),
    # Qwen3-8B's (hidden 4096, 36 layers, untied): for sizes only (tools/bench/offload_host.py);
    # its random weights would take 33 GB
    "qwen3-8b": dict(
        arch="qwen3",
        hidden=4096,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=12288,
        vocab_size=151_936,
        max_positions=40_960,
        rope_theta=1_000_000.0,
        tie_embeddings=False,
    ),
}
"""Named real configurations: ``make_tiny_model(out, **FLAVOURS[name])``."""


def make_tokenizer(out: Path, vocab_size: int = 0, chat_template: str = "plain"):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + CHARS
    # a real vocabulary's size: placeholder tokens that text never encodes to, but that decode
    tokens += [f"<extra_{i}>" for i in range(max(vocab_size - len(tokens), 0))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATES[chat_template]
    fast.save_pretrained(out)
    return fast


def make_tiny_model(
    out: str | Path,
    *,
    arch: str = "qwen3",
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    max_positions: int = 512,
    tie_embeddings: bool = True,
    seed: int = 0,
    head_dim: int = 0,
    vocab_size: int = 0,
    rope_theta: float = 10000.0,
    chat_template: str = "plain",
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 64,
    norm_topk_prob: bool = True,
    dense_layers: tuple[int, ...] = (),
) -> Path:
    """Write a random model with the char tokenizer to ``out`` and return the folder.

    ``vocab_size`` > the char tokenizer's pads the vocabulary (see :data:`FLAVOURS`); ``head_dim``
    0 is ``hidden // heads``; ``chat_template`` names one of :data:`CHAT_TEMPLATES`. ``qwen3_moe``
    replaces every layer's MLP by ``experts`` experts of width ``moe_intermediate``, ``top_k`` per
    token (Qwen3-30B-A3B's layout: no shared expert, top-k weights renormalized), except the
    ``dense_layers`` (HF's ``mlp_only_layers``), which keep a dense MLP."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out, vocab_size, chat_template)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "qwen3_moe":
        moe = Qwen3MoeConfig(
            **common,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(dense_layers),
        )
        model = Qwen3MoeForCausalLM(moe)
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=False, mlp_bias=False))
    else:
        raise ValueError(f"arch must be qwen3, qwen3_moe or llama, got {arch!r}")
    model.save_pretrained(out, safe_serialization=True)
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "llama", "qwen3_moe"])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    p.add_argument("--moe-intermediate", type=int, default=64, help="qwen3_moe: expert width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--chat-template", default="plain", choices=sorted(CHAT_TEMPLATES))
    p.add_argument("--flavour", choices=sorted(FLAVOURS), help="a real configuration instead")
    a = p.parse_args()
    if a.flavour:
        print(make_tiny_model(a.out, seed=a.seed, **FLAVOURS[a.flavour]))
        return
    path = make_tiny_model(
        a.out,
        arch=a.arch,
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
        tie_embeddings=not a.untied,
        seed=a.seed,
        max_positions=a.max_positions,
        chat_template=a.chat_template,
        experts=a.experts,
        top_k=a.top_k,
        moe_intermediate=a.moe_intermediate,
    )
    print(path)


if __name__ == "__main__":
    main()
