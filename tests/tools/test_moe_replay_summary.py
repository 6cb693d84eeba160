"""tools/moe_replay_summary.py: `make demo-moe`'s two RL runs side by side."""

from __future__ import annotations

import json

from tools.moe_replay_summary import main


def test_prints_both_runs_and_names_a_missing_summary(tmp_path, capsys):
    on = {"reward_start": 0.164, "reward_end": 0.922, "routing_agreement_mean": 0.956}
    off = {"reward_start": 0.164, "reward_end": 0.908, "mismatch_kl_mean": 6.4e-5}
    for name, s in (("demo_moe", on | {"mismatch_kl_mean": 3.5e-5}), ("demo_moe_noreplay", off)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("replay on") and "0.164 -> 0.922" in lines[0] and "0.956" in lines[0]
    assert (
        lines[1].startswith("replay off") and "agreement -" in lines[1] and "6.40e-05" in lines[1]
    )
    (tmp_path / "demo_moe_noreplay" / "summary.json").unlink()
    assert main([str(tmp_path)]) == 1
    assert "demo_moe_noreplay/summary.json: no summary" in capsys.readouterr().err
