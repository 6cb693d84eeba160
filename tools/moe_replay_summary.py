"""`make demo-moe`'s last line: its RL stage with routing replay beside the same stage without,
from the two runs' summary.json (asyncrl/summary.py writes the fields), so a reader sees what replay
changed without opening W&B.

    python tools/moe_replay_summary.py [RUNS_DIR]   # runs/demo_moe and runs/demo_moe_noreplay
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = (("replay on", "demo_moe"), ("replay off", "demo_moe_noreplay"))


def _f(v: object, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


def main(argv: list[str]) -> int:
    runs_dir = Path(argv[0]) if argv else Path("runs")
    for label, name in RUNS:
        path = runs_dir / name / "summary.json"
        if not path.is_file():
            print(f"moe_replay_summary: {path}: no summary (did the run finish?)", file=sys.stderr)
            return 1
        s = json.loads(path.read_text())
        print(
            f"{label:10}  held-out {_f(s.get('reward_start'), '.3f')} -> "
            f"{_f(s.get('reward_end'), '.3f')}  routing agreement "
            f"{_f(s.get('routing_agreement_mean'), '.3f')}  mismatch KL "
            f"{_f(s.get('mismatch_kl_mean'), '.2e')}  drift KL {_f(s.get('drift_kl_mean'), '.4f')}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
