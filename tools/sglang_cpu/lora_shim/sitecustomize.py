"""SGLang 0.5.23's LoRA layers allocate pinned host tensors unconditionally
(sglang/srt/lora/layers.py: ``torch.tensor(..., device="cpu", pin_memory=True)``), and pinning
needs a CUDA driver: on a CPU-only machine ``--enable-lora`` dies at start-up with "Found no NVIDIA
driver on your system". Pinned memory only speeds up host-to-GPU copies, which a CPU server never
makes, so without CUDA this makes pinning a no-op. On PYTHONPATH only for the servers started with
LoRA (tools/sglang_cpu/server.py: ``lora_env``); a machine with CUDA is left as it is."""

import functools

import torch

if not torch.cuda.is_available():

    def _unpinned(f):
        @functools.wraps(f)
        def call(*args, pin_memory=False, **kwargs):
            return f(*args, **kwargs)

        return call

    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
        setattr(torch, _name, _unpinned(getattr(torch, _name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
