"""A batched forward pass over a HuggingFace Llama-family model, with a slot KV cache.

transformers' own generation loop pays a lot of per-step Python (cache objects, mask builders, logits
processors) that dominates on CPU for small models, and its continuous batching is far too slow there.
So the engine runs the HF modules itself: the same weights and the same ops (RMSNorm, q/k norms for
Qwen3, rotary embedding, SDPA, MLP), but the KV cache is one preallocated tensor per layer with one row
("slot") per running request. Rows are kept compact (0..n-1): a finished request's row is overwritten
by the last one, so a decode step is a slice, never a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int


class SlotCache:
    """Per-layer K and V tensors ``[slots, kv_heads, capacity, head_dim]``; grows by doubling."""

    def __init__(
        self, shape: ModelShape, dtype: torch.dtype, *, slots: int = 8, capacity: int = 128
    ):
        self.shape = shape
        self.dtype = dtype
        self.slots = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(slots, min(capacity, shape.context))

    def ensure(self, slots: int, capacity: int) -> None:
        """Make room for ``slots`` rows of ``capacity`` positions, keeping what is stored."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_s = max(self.slots, 1)
        while new_s < slots:
            new_s *= 2
        new_c = max(self.capacity, 1)
        while new_c < capacity:
            new_c *= 2
        new_c = min(max(new_c, capacity), self.shape.context)
        sh = self.shape
        k = [torch.zeros(new_s, sh.kv_heads, new_c, sh.head_dim, dtype=self.dtype)]
        k = [torch.zeros_like(k[0]) for _ in range(sh.layers)]
        v = [torch.zeros_like(k[0]) for _ in range(sh.layers)]
        for i in range(len(self.k)):
            k[i][: self.slots, :, : self.capacity] = self.k[i]
            v[i][: self.slots, :, : self.capacity] = self.v[i]
        self.k, self.v, self.slots, self.capacity = k, v, new_s, new_c

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src`` (its first ``length`` positions) onto row ``dst``."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


class BatchedLM:
    """Prefill and decode over compact cache rows of a Llama-family HF model (fp32, no grad)."""

    def __init__(self, hf_model: torch.nn.Module):
        arch = type(hf_model).__name__
        if arch not in SUPPORTED:
            raise ValueError(f"model architecture {arch} is not supported (supported: {SUPPORTED})")
        self.hf = hf_model.eval()
        cfg = hf_model.config
        self.inner = hf_model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        context = int(cfg.max_position_embeddings)
        window = getattr(cfg, "sliding_window", None)
        windowed = getattr(cfg, "use_sliding_window", window is not None)
        if windowed and window:  # serve up to the window only: there, sliding attention is full
            context = min(context, int(window))
        self.shape = ModelShape(
            layers=len(self.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab=cfg.vocab_size,
            context=context,
        )
        self.dtype = next(hf_model.parameters()).dtype

    def new_cache(self, slots: int = 8) -> SlotCache:
        return SlotCache(self.shape, self.dtype, slots=slots)

    def _layers(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotCache,
        write,
        kv_len: int,
        rows: slice,
    ) -> torch.Tensor:
        """Run the decoder stack; ``write(layer, k, v)`` stores new K/V, attention reads ``[:kv_len]``.

        ``mask`` is boolean ``[b,1,q,kv_len]`` for prefill (SDPA) or an additive float ``[b,1,1,kv_len]``
        for decode, where one query per row makes two small matmuls cheaper than SDPA on CPU.
        Linear layers and norms are called functionally (same ops as the HF modules, less overhead).
        """
        cos, sin = self.inner.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, q = h.shape[:2]
        d = self.head_dim
        groups = self.heads // self.kv_heads
        for li, layer in enumerate(self.layers):
            a = layer.self_attn
            x = _rms(h, layer.input_layernorm)
            qs = _lin(x, a.q_proj).view(b, q, -1, d)
            ks = _lin(x, a.k_proj).view(b, q, -1, d)
            if hasattr(a, "q_norm"):
                qs, ks = _rms(qs, a.q_norm), _rms(ks, a.k_norm)
            qs, ks = qs.transpose(1, 2), ks.transpose(1, 2)
            vs = _lin(x, a.v_proj).view(b, q, -1, d).transpose(1, 2)
            qs = qs * cos + _rotate_half(qs) * sin
            ks = ks * cos + _rotate_half(ks) * sin
            write(li, ks, vs)
            keys = cache.k[li][rows, :, :kv_len]
            vals = cache.v[li][rows, :, :kv_len]
            if q == 1:
                s = torch.matmul(qs.view(b, self.kv_heads, groups, d), keys.transpose(-1, -2))
                p = torch.softmax(s * self.scaling + mask, dim=-1)
                o = torch.matmul(p, vals).view(b, 1, -1)
            else:
                o = F.scaled_dot_product_attention(
                    qs, keys, vals, attn_mask=mask, scale=self.scaling, enable_gqa=True
                )
                o = o.transpose(1, 2).reshape(b, q, -1)
            h = h + _lin(o, a.o_proj)
            m = layer.mlp
            x = _rms(h, layer.post_attention_layernorm)
            h = h + _lin(m.act_fn(_lin(x, m.gate_proj)) * _lin(x, m.up_proj), m.down_proj)
        return _rms(h, self.inner.norm)

    @torch.no_grad()
    def prefill(
        self, cache: SlotCache, first_row: int, seqs: list[list[int]], *, all_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fill rows ``first_row..`` with ``seqs`` from position 0.

        Returns the last position's logits ``[m, vocab]`` and, if ``all_logits``, every position's
        logits ``[m, L, vocab]`` (for prompt logprobs).
        """
        m = len(seqs)
        lens = torch.tensor([len(s) for s in seqs])
        L = int(lens.max())
        cache.ensure(first_row + m, L + 1)
        ids = torch.zeros(m, L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(L).unsqueeze(0).expand(m, L)
        ar = torch.arange(L)
        mask = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lens[:, None, None])
        mask = mask.unsqueeze(1)  # [m,1,L,L]
        rows = slice(first_row, first_row + m)

        def write(li, k, v):
            cache.k[li][rows, :, :L] = k
            cache.v[li][rows, :, :L] = v

        h = self._layers(self.inner.embed_tokens(ids), pos, mask, cache, write, L, rows)
        last = h[torch.arange(m), lens - 1]
        logits = self.hf.lm_head(last)
        full = self.hf.lm_head(h) if all_logits else None
        return logits, full

    @torch.no_grad()
    def decode(self, cache: SlotCache, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """One step for rows ``0..n-1``: row i feeds ``tokens[i]`` at position ``lengths[i]``."""
        n = len(tokens)
        lens = torch.tensor(lengths, dtype=torch.long)
        kv_len = int(lens.max()) + 1
        cache.ensure(n, kv_len)
        ids = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
        pos = lens.unsqueeze(1)
        mask = torch.zeros(n, 1, 1, kv_len)
        mask.masked_fill_(
            torch.arange(kv_len)[None, None, None, :] > lens.view(n, 1, 1, 1), float("-inf")
        )
        rows = slice(0, n)
        ridx = torch.arange(n)

        def write(li, k, v):
            cache.k[li][ridx, :, lens] = k[:, :, 0]
            cache.v[li][ridx, :, lens] = v[:, :, 0]

        h = self._layers(self.inner.embed_tokens(ids), pos, mask, cache, write, kv_len, rows)
        return self.hf.lm_head(h[:, 0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _lin(x: torch.Tensor, mod: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, mod.weight, mod.bias)


def _rms(x: torch.Tensor, mod: torch.nn.Module) -> torch.Tensor:
    """HF's Llama/Qwen3 RMSNorm, inlined: x * rsqrt(mean(x^2) + eps) * weight, in fp32."""
    if x.dtype == torch.float32:  # one fused kernel instead of five (a tenth of a decode step)
        return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.variance_epsilon)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)
    return mod.weight * xf.to(x.dtype)
