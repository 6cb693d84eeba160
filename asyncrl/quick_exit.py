"""End a process whose work is done without the interpreter's teardown.

Python's own exit frees every module and object one by one; with torch, transformers and
TorchTitan loaded that is 1.1–1.3 s on these cores (BENCHMARKS.md, session 20), paid after the
last file was written: at the end of every run it is the learner's last second and a half. A
process that has closed what it opened needs none of it. What must still happen does: the stdio
buffers are flushed and the ``atexit`` handlers run (logging's flush, any library's). While a
non-daemon thread is still alive the process exits as usual, as Python would wait for it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int) -> NoReturn:
    """Exit with ``code`` now: stdio flushed and ``atexit`` run, the teardown skipped."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)  # Python joins that thread first; so do we, by its own exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, or no stream at all
            pass
    os._exit(code)
