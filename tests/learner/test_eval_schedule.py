"""Which versions the learner evaluates: the first one, every ``run.eval_every``-th, the last; each
once. (Evaluating on real generators: tests/rollout/test_held_out_eval.py and tests/test_e2e.py.)"""

from __future__ import annotations

from asyncrl.learner.eval_schedule import Evaluator


def schedule(every: int, last: int, versions: list[int]) -> list[int]:
    ev = Evaluator(evaluation=None, every=every, last=last, timeout_s=1.0)
    done = []
    for v in versions:
        if ev.due(v):
            done.append(v)
            ev.reports[v] = None  # evaluated
    return done


def test_start_every_kth_and_last_each_once():
    assert schedule(10, 60, list(range(0, 61))) == [0, 10, 20, 30, 40, 50, 60]
    assert schedule(0, 60, list(range(0, 61))) == [0, 60]
    # weights.every skips versions; a resumed run starts at its checkpoint's version
    assert schedule(4, 20, [7, 8, 9, 12, 15, 20, 20]) == [7, 8, 12, 20]
    assert schedule(3, 5, [0, 0, 3, 3, 5]) == [0, 3, 5]
