"""The model servers that `asyncrl run` starts beside the policy's generators, each a section of
``rollout`` with ``path``, ``servers`` and ``batch_size`` (:data:`SERVED`): the reward model's
/classify servers (``rollout.reward_model``) and the distillation teacher's /generate servers
(``rollout.teacher``). Each is ``servers`` built-in engines (`asyncrl engine`) on the section's
``path``, supervised like the other children, healthy before the learner and the workers start,
their urls given to both in place of the path (the workers score rollouts with the reward model and
ask the teacher for logprobs; the learner's held-out evaluation scores with the reward model too
unless ``rollout.eval_reward`` names a rule).

Ports: each server binds port 0 and writes the port it got to a file (no port race); once it is
known, the child's argv names it, so a restarted server binds the same port and the urls the workers
hold stay right. While one restarts, its batches go to the next server, or fail as any reward does
(a recorded failure: :mod:`asyncrl.served.server_batches`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.launch.children import Child, stop_children
from asyncrl.launch.plan import LaunchError
from asyncrl.recipe import Recipe, RecipeError

HOST = "127.0.0.1"

SERVED = ("reward_model", "teacher")
"""The ``rollout`` sections whose ``path`` `asyncrl run` serves; a server child is named after its
section and index (``teacher0``)."""


def check_reward_model(r: Recipe) -> None:
    """RecipeError naming ``rollout.reward_model.path`` if it is not a sequence-classification
    folder: a causal LM's engine would start, answer /health, and 404 every /classify."""
    rm = r.rollout.reward_model
    if not rm.path or not r.algorithm.uses_rollouts:
        return
    from asyncrl.engine.classify import is_classifier

    if not is_classifier(r.resolve(rm.path)):
        raise RecipeError(
            f"{rm.path!r} is not a sequence-classification folder (its config.json names no "
            "*ForSequenceClassification architecture): give a reward_model run's export, e.g. "
            "runs/NAME/hf/latest",
            key="rollout.reward_model.path",
        )


def server_children(r: Recipe, run_dir: Path, sock_dir: Path) -> list[Child]:
    """One child per server of each served section with a path (:data:`SERVED`), port 0 with a
    port file in ``sock_dir`` ([] when no section has a path, or the recipe trains offline)."""
    if not r.algorithm.uses_rollouts:
        return []
    out = []
    for section in SERVED:
        cfg = getattr(r.rollout, section)
        if not cfg.path:
            continue
        model = str(r.resolve(cfg.path).resolve())
        for i in range(cfg.servers):
            name = f"{section}{i}"
            argv = [sys.executable, "-m", "asyncrl.cli", "engine", "--model", model]
            argv += ["--host", HOST, "--port", "0", "--port-file", str(sock_dir / f"{name}.port")]
            argv += ["--max-batch-size", str(cfg.batch_size)]
            out.append(Child(name=name, argv=argv, log=run_dir / "logs" / f"{name}.log"))
    return out


def section_of(child: Child) -> str:
    """The ``rollout`` section a server child serves (its name less its index)."""
    return child.name.rstrip("0123456789")


def port_file(child: Child) -> Path:
    return Path(child.argv[child.argv.index("--port-file") + 1])


def start_servers(children: Sequence[Child], env: dict[str, str], *, timeout_s: float) -> list[str]:
    """Start the servers, wait until each answers /health, pin each one's port in its argv (for
    restarts); returns their urls. LaunchError naming the server and its log's tail if one exits
    or is not healthy within ``timeout_s`` (all of them stopped)."""
    from asyncrl.generator_http import healthy, sync_client

    for c in children:
        port_file(c).unlink(missing_ok=True)
        c.start(env)
    urls: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    http = sync_client(2.0)
    try:
        while len(urls) < len(children):
            for c in children:
                if c.name in urls:
                    continue
                code = c.poll()
                if code is not None:
                    raise LaunchError(
                        f"model server {c.name} (rollout.{section_of(c)}.path) exited with "
                        f"code {code}; last lines of {c.log}:\n{c.tail()}"
                    )
                f = port_file(c)
                if f.is_file():
                    url = f"http://{HOST}:{int(f.read_text())}"
                    if healthy(http, url):
                        urls[c.name] = url
                        c.argv[c.argv.index("--port") + 1] = url.rsplit(":", 1)[1]
            if time.monotonic() > deadline:
                waiting = [c.name for c in children if c.name not in urls]
                raise LaunchError(
                    f"model server(s) {', '.join(waiting)} not healthy within "
                    f"{timeout_s:g} s (generator.startup_timeout_s); logs in "
                    f"{children[0].log.parent}"
                )
            time.sleep(0.1)
    except BaseException:
        stop_children(children, grace_s=10.0)
        raise
    finally:
        http.close()
    return [urls[c.name] for c in children]


def url_overrides(children: Sequence[Child], urls: Sequence[str]) -> list[str]:
    """The overrides that hand the started servers (``urls``, in ``children``'s order) to the
    learner and the workers: each section's urls, and no path (the two are exclusive in a
    recipe)."""
    out = []
    for section in SERVED:
        mine = [u for c, u in zip(children, urls, strict=True) if section_of(c) == section]
        if mine:
            quoted = ", ".join(f'"{u}"' for u in mine)
            out += [f"rollout.{section}.urls=[{quoted}]", f"rollout.{section}.path="]
    return out


def reward_model_summary(r: Recipe, run_dir: Path) -> dict[str, Any]:
    """summary.json's ``reward_model``: which model scored the rollouts and how well it ranks
    held-out pairs (``eval_accuracy``, the ``rm_eval_accuracy`` of the reward_model run that
    exported it, when the path is such a run's ``hf/...`` folder, else None); and the plot of its
    score against the true reward (plots/reward_model.png)."""
    from asyncrl import plots
    from asyncrl import summary as summary_mod

    rm = r.rollout.reward_model
    folder = r.resolve(rm.path).resolve()  # hf/latest -> hf/vN
    rm_run = folder.parent.parent if folder.parent.name == "hf" else None
    rm_summary = summary_mod.read_summary(rm_run) if rm_run is not None else None
    out: dict[str, Any] = {
        "path": rm.path,
        "servers": rm.servers,
        "eval_accuracy": (rm_summary or {}).get("rm_eval_accuracy"),
        "run_dir": str(rm_run) if rm_summary else None,
    }
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        plot = plots.plot_reward_model(plots.read_metrics(metrics), run_dir / "plots")
        out["plot"] = str(plot) if plot else None
    return out
