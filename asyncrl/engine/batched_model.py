"""A batched forward pass over a HuggingFace Llama-family model, with a slot KV cache.

transformers' own generation loop pays a lot of per-step Python (cache objects, mask builders, logits
processors) that dominates on CPU for small models, and its continuous batching is far too slow there.
So the engine runs the HF modules itself: the same weights and the same ops (RMSNorm, q/k norms for
Qwen3, rotary embedding, SDPA, MLP), but the KV cache is one preallocated tensor per layer with one row
("slot") per running request. Rows are kept compact (0..n-1): a finished request's row is overwritten
by the last one, so a decode step is a slice, never a gather.

At these sizes a decode step is mostly per-op overhead, so q/k/v and gate/up run as one matmul each
(the parameters become views into the fused tensors, so no memory is duplicated; the groups and
their layout are ``fused.py``'s) and rotary cos/sin come from a table. A weight swap re-points
parameters; :meth:`BatchedLM.prepare` fuses the incoming tensors off the decode thread (no copy when
they were received into the buffers :meth:`BatchedLM.receive_buffers` lays out) and
:meth:`BatchedLM.refresh` adopts them, so the swap stays a pointer swap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncrl.engine.fused import FUSED, Fused, Group, ReceiveBuffers, fuse, ptrs
from asyncrl.engine.transfer import to_device

SUPPORTED = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",
)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only


class Expert(torch.nn.Module):
    """One expert's SwiGLU MLP, under a checkpoint's names (``gate_proj``, ``up_proj``,
    ``down_proj``)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
            setattr(self, name, lin)


class Experts(torch.nn.ModuleList):
    """An MoE layer's experts as separate modules, in place of transformers 5's fused 3-D tensors
    (``experts.gate_up_proj [E, 2F, D]``, ``experts.down_proj [E, D, F]``).

    So the engine's parameters carry the names of the checkpoint, SGLang's and the learner's
    broadcast (``mlp.experts.{e}.gate_proj.weight``...): a weight update, a load from disk and the
    checksum resolve them like every other tensor. ``forward`` keeps transformers' signature, so the
    HF module still runs as it did."""

    @classmethod
    def split(cls, fused: torch.nn.Module) -> Experts:
        gu, down = fused.gate_up_proj.detach(), fused.down_proj.detach()
        f = gu.shape[1] // 2
        return cls(Expert(gu[e, :f], gu[e, f:], down[e]) for e in range(gu.shape[0]))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return _experts(self, x, top_k_index, top_k_weights)


def split_experts(hf_model: torch.nn.Module) -> int:
    """Replace every MoE layer's fused experts by :class:`Experts`; returns how many layers."""
    n = 0
    for layer in hf_model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            layer.mlp.experts = Experts.split(experts)
            n += 1
    return n


def _experts(
    experts: torch.nn.ModuleList, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Σ_k weight_k · expert_{idx_k}(x) for tokens ``x [T, D]``, expert by expert over the tokens
    routed to it, summed in expert order as transformers' ``Qwen3MoeExperts`` does."""
    out = torch.zeros_like(x)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    # the tokens per expert, read once (bincount would wait for the device twice on CUDA: it
    # reads the ids' maximum to size its output)
    counts = torch.zeros(len(experts), dtype=torch.long, device=flat.device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat)).tolist()
    k = idx.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        sel = order[start : start + n]
        start += n
        tok = sel // k
        ex = experts[e]
        xe = x[tok]
        y = _lin(F.silu(_lin(xe, ex.gate_proj)) * _lin(xe, ex.up_proj), ex.down_proj)
        out.index_add_(0, tok, y * weights.flatten()[sel, None].to(y.dtype))
    return out


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
        self,
        shape: ModelShape,
        dtype: torch.dtype,
        *,
        slots: int = 8,
        capacity: int = 128,
        device: torch.device | str = "cpu",
    ):
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
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
        k = [
            torch.zeros(
                new_s, sh.kv_heads, new_c, sh.head_dim, dtype=self.dtype, device=self.device
            )
        ]
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
    """Prefill and decode over compact cache rows of a Llama-family HF model, no grad, on the
    model's device and in its dtype (float32 on CPU, the recipe's ``model.dtype`` on CUDA): the KV
    cache, the ids, masks and positions of every step live there too."""

    def __init__(self, hf_model: torch.nn.Module):
        arch = type(hf_model).__name__
        if arch not in SUPPORTED:
            raise ValueError(f"model architecture {arch} is not supported (supported: {SUPPORTED})")
        self.hf = hf_model.eval()
        cfg = hf_model.config
        split_experts(hf_model)  # before reading parameter names: the experts get the checkpoint's
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.moe_layers = [
            i
            for i, layer in enumerate(hf_model.model.layers)
            if isinstance(getattr(layer.mlp, "experts", None), Experts)
        ]
        self.norm_topk = bool(getattr(cfg, "norm_topk_prob", False))
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
        first = next(hf_model.parameters())
        self.dtype, self.device = first.dtype, first.device
        rope = self.inner.rotary_emb
        self._rope_table = getattr(rope, "rope_type", "default") in STATIC_ROPE
        self._cos = self._sin = torch.empty(0)
        self.fused: dict[tuple[int, str], Fused] = {}
        self._prepared: dict[tuple[int, ...], Fused] = {}
        self._names = {id(p): n for n, p in hf_model.named_parameters()}
        self.groups = self._groups()
        act = getattr(cfg, "hidden_act", None)
        self._act = F.silu if act in ("silu", "swish") else self.layers[0].mlp.act_fn
        self.qk_norm: dict[int, torch.Tensor] = {}  # Qwen3: q_norm and k_norm weights, per head
        self._qk_ptrs: dict[int, tuple[int, int]] = {}
        with torch.no_grad():
            self.refresh()

    # ---- fused projections (fused.py) ------------------------------------------------------------

    def _members(self) -> list[tuple[tuple[int, str], list[torch.nn.Linear]]]:
        out = []
        for li, layer in enumerate(self.layers):
            for block, names in FUSED:
                if not hasattr(getattr(layer, block), names[0]):  # an MoE layer's mlp: no gate_proj
                    continue
                mods = [getattr(getattr(layer, block), n) for n in names]
                out.append(((li, block), mods))
        return out

    def _groups(self) -> list[Group]:
        out = []
        for key, mods in self._members():
            biases = [m.bias for m in mods]
            out.append(
                Group(
                    key=key,
                    weights=tuple(self._names[id(m.weight)] for m in mods),
                    biases=None
                    if any(b is None for b in biases)
                    else tuple(self._names[id(b)] for b in biases),
                    rows=tuple(m.weight.shape[0] for m in mods),
                    cols=mods[0].weight.shape[1],
                )
            )
        return out

    def receive_buffers(self) -> ReceiveBuffers:
        """Fresh buffers for one weight-update session: receiving the fused groups' members there
        lets :meth:`prepare` adopt them without a copy."""
        return ReceiveBuffers(self.groups, self.dtype, self.device)

    def prepare(self, staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fuse incoming weights ahead of a swap (any thread, not the decode one), so that
        :meth:`refresh` after the swap only re-points: every fused group ``staged`` touches is
        built from the staged and current tensors, adopted as it is when its members were received
        into one buffer (:meth:`receive_buffers`), else copied into one tensor and its members
        staged as views into it. In place: a copied group's separate tensors are let go as soon as
        it is fused (one group's worth of extra memory, not all of them)."""
        for g, mods in zip(self.groups, (m for _, m in self._members()), strict=True):
            bnames = g.biases or (None,) * len(mods)
            if not any(k in staged for k in (*g.weights, *(g.biases or ()))):
                continue
            f, views = fuse(
                [staged.get(kw, m.weight.data) for m, kw in zip(mods, g.weights, strict=True)],
                [kb and staged.get(kb, m.bias.data) for m, kb in zip(mods, bnames, strict=True)],
            )
            for kw, kb, (w, b) in zip(g.weights, bnames, views, strict=True):
                staged[kw] = w
                if kb:
                    staged[kb] = b
            self._prepared[f.ptrs] = f
        return staged

    def refresh(self) -> None:
        """Bring the fused tensors in line with the parameters (at load and after every swap).
        Prepared groups are adopted as they are; any other change is fused here (a copy)."""
        for key, mods in self._members():
            current = ptrs((m.weight, m.bias) for m in mods)
            f = self.fused.get(key)
            if f is not None and f.ptrs == current:
                continue
            f = self._prepared.get(current)
            if f is None:
                f, views = fuse(
                    [m.weight.data for m in mods],
                    [None if m.bias is None else m.bias.data for m in mods],
                )
                for m, (w, b) in zip(mods, views, strict=True):
                    m.weight.data = w
                    if b is not None:
                        m.bias.data = b
            self.fused[key] = f
        self._prepared.clear()
        for li, layer in enumerate(self.layers):
            a = layer.self_attn
            if not hasattr(a, "q_norm"):
                continue
            qk = (a.q_norm.weight.data_ptr(), a.k_norm.weight.data_ptr())
            if self._qk_ptrs.get(li) != qk:  # a few KB per layer: cheap even in the swap
                qw, kw = a.q_norm.weight.detach(), a.k_norm.weight.detach()
                self.qk_norm[li] = torch.cat(
                    (qw.expand(self.heads, -1), kw.expand(self.kv_heads, -1))
                )
                self._qk_ptrs[li] = qk

    # ---- forward ---------------------------------------------------------------------------------

    def _rope(
        self, h: torch.Tensor, pos: torch.Tensor, need: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[b, 1, q, head_dim]`` for positions ``pos [b, q]``: the sin's first
        half is negated, so that ``rotate_half(x) * sin == x.roll(d / 2) * signed``, one op.
        ``need``: one more than the largest position, which the caller knows on the host (reading
        ``pos.max()`` back would make every step wait for the device)."""
        if not self._rope_table:
            cos, sin = self.inner.rotary_emb(h, pos)
            return cos.unsqueeze(1), _signed(sin).unsqueeze(1)
        if need > self._cos.shape[0] or self._cos.dtype != h.dtype:
            n = min(max(need, 2 * self._cos.shape[0], 256), max(need, self.shape.context))
            cos, sin = self.inner.rotary_emb(h, torch.arange(n, device=h.device).unsqueeze(0))
            self._cos, self._sin = cos[0], _signed(sin[0])
        return self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.inner.embed_tokens.weight)

    def new_cache(self, slots: int = 8) -> SlotCache:
        return SlotCache(self.shape, self.dtype, slots=slots, device=self.device)

    def _layers(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotCache,
        write,
        kv_len: int,
        rows: slice,
        record: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the decoder stack; ``write(layer, k, v)`` stores new K/V, attention reads ``[:kv_len]``
        (one more than the largest position in ``pos``). ``record``: a list that gets each MoE
        layer's chosen experts ``[b, q, top_k]``, in layer order.

        ``mask`` is boolean ``[b,1,q,kv_len]`` for prefill (SDPA) or an additive float ``[b,1,1,kv_len]``
        for decode, where one query per row makes two small matmuls cheaper than SDPA on CPU.
        Linear layers and norms are called functionally (same ops as the HF modules, less overhead).
        """
        cos, sin = self._rope(h, pos, kv_len)
        b, q = h.shape[:2]
        d, heads, kv_heads = self.head_dim, self.heads, self.kv_heads
        groups = heads // kv_heads
        for li, layer in enumerate(self.layers):
            a = layer.self_attn
            x = _rms(h, layer.input_layernorm)
            qkv = self.fused[li, "self_attn"]
            out = F.linear(x, qkv.weight, qkv.bias)
            # q and k side by side: their norms and rotary run once for both
            qk = out[..., : (heads + kv_heads) * d].view(b, q, heads + kv_heads, d)
            vs = out[..., (heads + kv_heads) * d :].view(b, q, kv_heads, d).transpose(1, 2)
            if li in self.qk_norm:
                qk = _rms_w(qk, self.qk_norm[li], a.q_norm.variance_epsilon)
            qk = qk.transpose(1, 2)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            qs, ks = qk[:, :heads], qk[:, heads:]
            write(li, ks, vs)
            keys = cache.k[li][rows, :, :kv_len]
            vals = cache.v[li][rows, :, :kv_len]
            if q == 1:
                s = torch.matmul(qs.reshape(b, kv_heads, groups, d), keys.transpose(-1, -2))
                z = s * self.scaling + mask
                # float32 on CPU; in half precision the softmax runs in float32, as HF's does
                p = torch.softmax(z, -1) if z.dtype == torch.float32 else z.float().softmax(-1)
                p = p.to(vals.dtype)
                o = torch.matmul(p, vals).view(b, 1, -1)
            else:
                o = F.scaled_dot_product_attention(
                    qs, keys, vals, attn_mask=mask, scale=self.scaling, enable_gqa=True
                )
                o = o.transpose(1, 2).reshape(b, q, -1)
            h = h + _lin(o, a.o_proj)
            x = _rms(h, layer.post_attention_layernorm)
            if isinstance(getattr(layer.mlp, "experts", None), Experts):
                h = h + self._moe(x, layer.mlp, record)
                continue
            gu = self.fused[li, "mlp"]
            gate, up = F.linear(x, gu.weight, gu.bias).chunk(2, dim=-1)
            h = h + _lin(self._act(gate) * up, layer.mlp.down_proj)
        return _rms(h, self.inner.norm)

    def _moe(
        self, x: torch.Tensor, mlp: torch.nn.Module, record: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """A Qwen3-MoE block as transformers computes it: softmax of the router's logits in
        float32, the top-k experts, their weights renormalized when ``norm_topk_prob``, cast back
        to the activations' dtype. ``record`` gets the chosen experts ``[*x.shape[:-1], top_k]``."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(flat, mlp.gate.weight), -1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if record is not None:
            record.append(idx.view(*shape[:-1], self.top_k))
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        return _experts(mlp.experts, flat, idx, top.to(x.dtype)).view(shape)

    def _routes(self, record: list[torch.Tensor], out: list[torch.Tensor] | None) -> None:
        """The experts ``record`` holds (one ``[b, q, top_k]`` per MoE layer) as SGLang lays them
        out, appended to ``out``: int32 on the host, ``[b, q, num_hidden_layers, top_k]``, zeros
        in a dense layer's row (SGLang's capture buffer is zeroed and only MoE layers write it)."""
        if out is None:
            return
        b, q = record[0].shape[:2] if record else (0, 0)
        routes = torch.zeros(b, q, len(self.layers), self.top_k, dtype=torch.int32)
        if record:  # every MoE layer's in one copy: on CUDA one wait for the device, not one each
            routes[:, :, self.moe_layers] = torch.stack(record, 2).to("cpu", torch.int32)
        out.append(routes)

    def prefill(
        self,
        cache: SlotCache,
        first_row: int,
        seqs: list[list[int]],
        *,
        all_logits: bool = False,
        routes: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fill rows ``first_row..`` with ``seqs`` from position 0.

        Returns the last position's logits ``[m, vocab]`` and, if ``all_logits``, every position's
        logits ``[m, L, vocab]`` (for prompt logprobs). Callers turn autograd off (the decode
        thread runs under ``torch.no_grad``: a decorator here costs a few % of a step).
        ``routes`` (an MoE model's): a list that gets the experts every position chose
        ``[m, L, num_hidden_layers, top_k]`` (:meth:`_routes`); only then are they read back.
        """
        m = len(seqs)
        L = max(len(s) for s in seqs)
        cache.ensure(first_row + m, L + 1)
        # built on the host and sent in one copy: one small transfer, not one per sequence
        flat = [t for s in seqs for t in (*s, *[0] * (L - len(s)))] + [len(s) for s in seqs]
        both = to_device(flat, torch.long, self.device)
        ids, lens = both[: m * L].view(m, L), both[m * L :]
        ar = torch.arange(L, device=self.device)
        pos = ar.unsqueeze(0).expand(m, L)
        mask = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lens[:, None, None])
        mask = mask.unsqueeze(1)  # [m,1,L,L]
        rows = slice(first_row, first_row + m)

        def write(li, k, v):
            cache.k[li][rows, :, :L] = k
            cache.v[li][rows, :, :L] = v

        record = [] if routes is not None else None
        h = self._layers(self._embed(ids), pos, mask, cache, write, L, rows, record)
        self._routes(record or [], routes)
        last = h[torch.arange(m, device=self.device), lens - 1]
        logits = _lin(last, self.hf.lm_head)
        full = _lin(h, self.hf.lm_head) if all_logits else None
        return logits, full

    def decode(
        self,
        cache: SlotCache,
        tokens: list[int],
        lengths: list[int],
        *,
        routes: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One step for rows ``0..n-1``: row i feeds ``tokens[i]`` at position ``lengths[i]``;
        ``routes`` as :meth:`prefill`'s (``[n, 1, num_hidden_layers, top_k]``).

        Nothing here waits for the device: the sizes come from the host's ``lengths``, and the ids
        and positions go over in one copy that does not block (``transfer.to_device``)."""
        n = len(tokens)
        dev = self.device
        kv_len = max(lengths) + 1
        cache.ensure(n, kv_len)
        both = to_device([*tokens, *lengths], torch.long, dev)
        ids, lens = both[:n].unsqueeze(1), both[n:]
        pos = lens.unsqueeze(1)
        mask = torch.zeros(n, 1, 1, kv_len, dtype=self.dtype, device=dev)  # the scores' dtype
        mask.masked_fill_(
            torch.arange(kv_len, device=dev)[None, None, None, :] > lens.view(n, 1, 1, 1),
            float("-inf"),
        )
        rows = slice(0, n)
        ridx = torch.arange(n, device=dev)

        def write(li, k, v):
            cache.k[li][ridx, :, lens] = k[:, :, 0]
            cache.v[li][ridx, :, lens] = v[:, :, 0]

        record = [] if routes is not None else None
        h = self._layers(self._embed(ids), pos, mask, cache, write, kv_len, rows, record)
        self._routes(record or [], routes)
        return _lin(h[:, 0], self.hf.lm_head)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _lin(x: torch.Tensor, mod: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, mod.weight, mod.bias)


def _rms(x: torch.Tensor, mod: torch.nn.Module) -> torch.Tensor:
    """HF's Llama/Qwen3 RMSNorm, inlined: x * rsqrt(mean(x^2) + eps) * weight, in fp32."""
    return _rms_w(x, mod.weight, mod.variance_epsilon)


def _rms_w(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as HF computes it: normalised in fp32, cast back to ``x``'s dtype,
    then scaled by ``weight`` (broadcast over the leading dims). One fused kernel for the
    normalisation instead of seven (a tenth of a CPU decode step; on CUDA, where a small decode
    step is mostly kernel launches, more). In half precision the weight multiplies the rounded
    value in ``x``'s dtype, as HF's does: ``rms_norm`` with the weight would scale before
    rounding, one rounding off transformers' (and the engine's earlier) numbers."""
    if x.dtype == torch.float32 and weight.shape == x.shape[-1:]:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
