"""asyncrl.malloc: with its settings, a process that allocates and frees 1 MB messages stops
faulting them in page by page (measured in fresh processes, one per setting)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl import malloc

_CHILD = """
import json, resource, sys
from asyncrl import malloc
tuned = sys.argv[1] == "tuned" and malloc.keep_freed_memory()
keep = bytearray(1 << 16)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(200):  # a message and its copy (encoded, then handed to nng): written, freed
    msg, copy = bytearray(1 << 20), bytearray(1 << 20)
    msg[::4096] = copy[::4096] = b"x" * 256
    del msg, copy
print(json.dumps({"tuned": bool(tuned), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
"""


def _faults(setting: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, setting], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_messages_stay_mapped():
    assert malloc.keep_freed_memory()
    default, tuned = _faults("default"), _faults("tuned")
    assert tuned["tuned"] and not default["tuned"]
    assert default["faults"] > 200 * 100  # each time faulted in again: up to 512 pages
    assert tuned["faults"] < 1000, tuned
