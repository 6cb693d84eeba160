"""Time the built-in engine's decode step in-process: one ``BatchedLM.decode`` and one ``sample``.

    python tools/bench/engine_step.py [--batch 8 64] [--steps 300] [--prompt 16] [--window 64]
                                      [--sampled] [--against CHECKOUT]

tools/bench/engine.py measures the engine as a run uses it (HTTP, continuous batching), where on a
shared 2-core machine the client, the server and the load around them make a few per cent vanish in
the noise. This times only what a decode step runs, on the tiny Qwen3 of tools/make_tiny_model.py,
in float32 on the CPU with one thread: per batch size the median of a step (decode + sample, the
tokens read back as the decode loop reads them) over ``--steps`` steps after a warm-up, in wall ms
and in this thread's CPU ms. Each row decodes positions ``prompt .. prompt + window`` and starts
over there, so that every step attends to as many positions on average, however many steps. Greedy unless ``--sampled`` (temperature 1, the engine's generator).

``--against CHECKOUT``: the same steps with another checkout's ``engine/batched_model.py`` and
``engine/sampling.py`` (loaded from there; what they import from asyncrl comes from this one),
interleaved step by step with this checkout's on the same weights, so that the load of the moment
falls on both alike (each goes first every other step); it reports both medians and the median of
the per-step ratios, wall and CPU (this checkout over the other). On a loaded machine that ratio is the figure to read, not the two rates.
Last line: JSON {"bench": "engine_step", "step_ms": {batch: ms}, ...}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from asyncrl.engine import batched_model as this_model  # noqa: E402
from asyncrl.engine import sampling as this_sampling  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402


def _load(checkout: Path, name: str, before: str | None = None) -> ModuleType:
    """``before``: the module's name in a checkout from before issue #47 item 7 renamed it."""
    path = checkout / f"asyncrl/engine/{name}.py"
    if not path.exists() and before is not None:
        name = before
        path = checkout / f"asyncrl/engine/{name}.py"
    if not path.exists():  # a checkout from before the engine left rollout/ (issue #47)
        path = checkout / f"asyncrl/rollout/engine/{name}.py"
        old = "asyncrl.rollout.engine"  # its imports of its siblings: this checkout's
        for m in [k for k in sys.modules if k.startswith("asyncrl.engine.")]:
            sys.modules.setdefault(old + m.removeprefix("asyncrl.engine"), sys.modules[m])
    spec = importlib.util.spec_from_file_location(f"other_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class Stepper:
    """One version's decode loop over its own cache: ``step()`` runs one decode and its sample."""

    def __init__(
        self, model_mod, sampling_mod, hf, batch: int, prompt: int, window: int, sampled: bool
    ):
        g = torch.Generator().manual_seed(0)
        self.prompt, self.window = prompt, window
        self.lm = model_mod.BatchedLM(hf)
        prompts = torch.randint(3, self.lm.shape.vocab, (batch, prompt), generator=g).tolist()
        self.sample = sampling_mod.sample
        self.params = [sampling_mod.EngineSamplingParams(temperature=float(sampled))] * batch
        self.gens, self.gen = [None] * batch, torch.Generator().manual_seed(0)
        self.cache = self.lm.new_cache(batch)
        logits, _ = self.lm.prefill(self.cache, 0, prompts)
        self.tokens = self.sample(logits, self.params, self.gens, self.gen).tokens
        self.lengths = [prompt] * batch

    def step(self) -> tuple[float, float]:
        """Wall and CPU seconds of one step."""
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = self.lm.decode(self.cache, self.tokens, self.lengths)
        self.tokens = self.sample(logits, self.params, self.gens, self.gen).tokens
        out = time.perf_counter() - t0, time.thread_time() - c0
        self.lengths = [n + 1 for n in self.lengths]
        if self.lengths[0] >= self.prompt + self.window:  # back: every step costs alike
            self.lengths = [self.prompt] * len(self.lengths)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--against", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="bench-engine-step-") as tmp:
        path = make_tiny_model(Path(tmp) / "tiny_qwen3")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    versions = {"this": (this_model, this_sampling)}
    if a.against is not None:
        versions["other"] = (
            _load(a.against, "batched_model", "model"),
            _load(a.against, "sampling"),
        )
    result: dict = {"bench": "engine_step", "sampled": a.sampled, "steps": a.steps}
    with torch.no_grad():
        for b in a.batch:
            steppers = {
                k: Stepper(*v, hf, b, a.prompt, a.window, a.sampled) for k, v in versions.items()
            }
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in steppers}
            order = list(steppers)
            for i in range(a.steps + 10):  # the first 10 warm up
                for k in order if i % 2 else order[::-1]:  # each goes first every other step
                    t = steppers[k].step()
                    if i >= 10:
                        times[k].append(t)
            for k, ts in times.items():
                wall = statistics.median(t[0] for t in ts) * 1e3
                cpu = statistics.median(t[1] for t in ts) * 1e3
                key = "" if k == "this" else "other_"
                result.setdefault(f"{key}step_ms", {})[b] = round(wall, 4)
                result.setdefault(f"{key}step_cpu_ms", {})[b] = round(cpu, 4)
                result.setdefault(f"{key}tok_s", {})[b] = round(b / wall * 1e3, 1)
                print(f"{k} batch {b}: {wall:.3f} ms a step ({cpu:.3f} ms CPU)", flush=True)
            if "other" in times:
                pairs = list(zip(times["this"], times["other"], strict=True))
                for j, what in enumerate(("step", "step_cpu")):
                    ratio = statistics.median(x[j] / y[j] for x, y in pairs)
                    result.setdefault(f"this_over_other_{what}", {})[b] = round(ratio, 4)
                    print(f"batch {b}: this checkout's {what} / the other's, median {ratio:.4f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
