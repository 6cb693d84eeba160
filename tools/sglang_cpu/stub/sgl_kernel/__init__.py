"""Import-only stand-in for SGLang's ``sgl_kernel`` package: TEST INFRASTRUCTURE, never a kernel.

SGLang 0.5.23's CPU path imports names from ``sgl_kernel`` at module load, and no CPU build of that
package exists on PyPI. With ``--attention-backend torch_native`` and a small dense Llama/Qwen3 model,
none of those names is ever *called*: SGLang falls back to its torch-native paths. So this module only
has to satisfy the imports. Every name it hands out is a function that raises on call, so a test can
never pass by silently skipping real work: if SGLang ever calls into it, the server fails loudly.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} was called (it must never be)")

    _missing.__name__ = name
    return _missing
