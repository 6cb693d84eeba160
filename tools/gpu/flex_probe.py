"""TorchTitan's flex attention path on CPU, forward only: the part of the GPU check's flex learner
that a CPU can run, for tools/gpu/host_env.sh.

asyncrl's learner never takes this path on CPU: flex_attention has no CPU backward, so
``model.attention: flex`` is refused there and ``auto`` picks the per-document SDPA. A torch API that
TorchTitan's flex path needs and the lent host's torch lacks (``create_block_mask``'s
``separate_full_blocks``, which torch 2.11 lacks) would therefore first fail on a GPU. This runs that
path: asyncrl's model spec of the tiny test model with TorchTitan's ``FlexAttention`` inside, its
block mask from packed positions (TorchTitan's ``get_attention_masks``: the compiled
``create_block_mask``), one forward without gradients against the same weights under the
per-document SDPA, and one forward with gradients whose backward records whether flex trains on
this torch and CPU (torch refuses it: the error is recorded, not a failure).

    python tools/gpu/flex_probe.py WORK      # last line: JSON figures; exit 0 when the forward matches
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-4
"""Largest |Δ logit| between flex and the per-document SDPA over the largest |logit|, float32: two
exact attentions that differ only in summation order."""


def _model(folder: Path, kind: str, seq: int):  # type: ignore[no-untyped-def]
    """TorchTitan's decoder for ``folder`` on the CPU, its inner attention ``kind``. asyncrl's
    ``build_spec`` refuses flex on CPU (it cannot train there), so the flex model is the SDPA spec
    with TorchTitan's ``FlexAttention`` put in as each layer's inner attention."""
    import torch

    from asyncrl.learner.attention import inner_attention_config
    from asyncrl.learner.model_spec import build_spec

    spec = build_spec(folder, attention="sdpa", max_seq_len=seq)
    for layer in spec.model.layers:
        layer.attention.inner_attention = inner_attention_config(kind)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def probe(work: Path) -> dict[str, Any]:
    import torch

    from asyncrl.learner.attention import attention_masks
    from tools.gpu.check import tiny_model

    torch.manual_seed(0)
    seq = 256  # two of flex's 128-token blocks per row
    folder = tiny_model(work)
    flex = _model(folder, "flex", seq)
    sdpa = _model(folder, "sdpa", seq)
    sdpa.load_state_dict(flex.state_dict())
    vocab = flex.tok_embeddings.weight.shape[0]
    tokens = torch.randint(3, vocab, (2, seq))
    # packed rows: three documents in the first row (one crossing a block edge), one in the second
    positions = torch.cat(
        [torch.cat([torch.arange(n) for n in (100, 60, 96)])[None], torch.arange(seq)[None]]
    )
    figs: dict[str, Any] = {"torch": torch.__version__}
    shim = sys.modules.get("sitecustomize")
    figs["shim_patched"] = getattr(shim, "PATCHED", None)
    t0 = time.perf_counter()
    masks = attention_masks(flex, positions)
    figs["mask_s"] = round(time.perf_counter() - t0, 2)
    figs["mask"] = type(masks).__name__
    figs["full_blocks_separate"] = getattr(masks, "full_kv_num_blocks", None) is not None
    with torch.no_grad():
        t0 = time.perf_counter()
        got = flex(tokens, positions, masks)
        figs["forward_s"] = round(time.perf_counter() - t0, 2)
        want = sdpa(tokens, positions, attention_masks(sdpa, positions))
    scale = float(want.abs().max())
    figs["logits_rel_diff"] = float((got - want).abs().max()) / scale
    figs["forward_ok"] = figs["logits_rel_diff"] < TOLERANCE
    try:
        flex(tokens, positions, masks).float().sum().backward()
        figs["trains_on_cpu"] = True
    except Exception as e:  # recorded: the answer to "does flex train on this torch's CPU?"
        figs["trains_on_cpu"] = False
        figs["backward_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    figs["ok"] = figs["forward_ok"]
    return figs


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: flex_probe.py WORK", file=sys.stderr)
        return 2
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    figs = probe(work)
    print(json.dumps(figs))
    return 0 if figs["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
