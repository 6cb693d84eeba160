"""The TorchTitan learner (docs/design.md §5).

Importing the package applies the CPU shims first (``cpu_shims``): TorchTitan copies its device type at
import time, so the patch must precede every other TorchTitan import.
"""

from asyncrl.learner import cpu_shims as _cpu_shims  # noqa: F401
