"""torchrun worker for tests/weights/test_broadcast.py: a 2-rank learner publishing to engines.

    torchrun --nproc_per_node 2 tests/weights/ranks_worker.py MODEL_DIR OUT_DIR URL[,URL...]

Every rank builds the Trainer and a WeightBroadcaster (only rank 0 sends), takes two SFT steps and
exports the final weights; rank 0 writes ``OUT_DIR/result.json`` with the reports and the checksum of
the learner's final HF state dict.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncrl import wire  # noqa: E402
from asyncrl.recipe import WeightsConfig  # noqa: E402
from asyncrl.weights.broadcaster import WeightBroadcaster  # noqa: E402
from asyncrl.weights.buckets import checksum  # noqa: E402
from asyncrl.weights.snapshot import drop_tied  # noqa: E402
from tests.weights.test_broadcast import make_trainer, sft_batch, step_and_publish  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model_dir, out, urls = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    tr = make_trainer(model_dir, out)
    b = WeightBroadcaster(
        WeightsConfig(timeout_s=30.0, bucket_mb=0.1), export_dir=tr.run_dir / "hf"
    )
    assert b.rank == tr.rank
    if tr.rank == 0:
        for u in urls:
            b.add_generator(wire.GeneratorInfo(url=u, kind="builtin"))
    vocab = tr.models.spec.model.vocab_size
    for v in (1, 2):
        step_and_publish(tr, b, sft_batch(v - 1, vocab, seed=v))
    assert b.wait(timeout=120), "the broadcaster did not finish its versions in 120 s"
    tr.export_hf(out / "export")
    want = checksum(drop_tied(tr.hf_state_dict()).items())
    if tr.rank == 0:
        reports = [
            {k: v for k, v in dataclasses.asdict(r).items() if k != "pause_s"} for r in b.reports
        ]
        (out / "result.json").write_text(
            json.dumps({"world": tr.world, "checksum": want, "reports": reports})
        )
    b.close()
    tr.close()


if __name__ == "__main__":
    main()
