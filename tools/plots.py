"""metrics.jsonl -> PNG plots of a run: the CLI of :mod:`asyncrl.plots` (`asyncrl run` calls it too).

python tools/plots.py runs/demo/metrics.jsonl [--out runs/demo/plots]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.plots import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
