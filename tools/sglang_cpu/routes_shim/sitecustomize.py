"""SGLang 0.5.23 keeps the routed experts of every KV slot in a host buffer it allocates pinned
(sglang/srt/state_capturer/base.py:63-75, ``BaseHostCache``: ``ALLOC_MEMORY_FUNCS[device]`` at :67,
``pin_memory=True`` at :72), made when the model runner starts (srt/model_executor/model_runner.py:
1229-1238). The table's default for a device it does not list ("cpu" is not) is
``alloc_with_host_register`` (sglang/srt/mem_cache/pool_host/common.py:453-460, :330-351), which
registers the buffer with ``cudaHostRegister`` through ``torch.cuda.cudart()`` (common.py:147): that
needs a CUDA driver. So on a CPU-only machine ``--enable-return-routed-experts`` dies at start-up with
"Found no NVIDIA driver on your system" (a model without the flag serves). Pinning only speeds up
host-to-GPU copies, which a CPU server never makes: without CUDA this makes the "cpu" entry a
plain allocation, right after SGLang's module defines the table (before anything allocates with
it). On PYTHONPATH only for the servers started with routes (tools/sglang_cpu/server.py:
``routes_env``); a machine with CUDA is left as it is."""

import importlib.abc
import importlib.machinery
import sys

import torch

_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds SGLang's module as usual, then sets the "cpu" allocator once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.ALLOC_MEMORY_FUNCS["cpu"] = _plain

        spec.loader.exec_module = exec_module
        return spec


if not torch.cuda.is_available():
    sys.meta_path.insert(0, _AfterImport())
