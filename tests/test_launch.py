"""The launcher's process handling, plan and metrics tail, with real processes (no learner needed).

The whole-system runs are in tests/test_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl import launch, learner_info, metric_names, progress, recipe
from asyncrl.launch.children import Child, restart_the_dead, stop_children
from asyncrl.launch.plan import make_plan, prepare_run_dir

ROOT = Path(__file__).resolve().parents[1]

# A child that starts a grandchild in its own group and ignores SIGTERM if asked: the shapes of
# torchrun (agent + ranks) and of a rollout worker (worker + engines).
TREE = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    g = subprocess.Popen([sys.executable, "-c", "import time, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN) if %r == 'stubborn' else None; time.sleep(600)" % sys.argv[1]])
    print(g.pid, flush=True)
    time.sleep(600)
    """
)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours still answers kill(0): reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        if _is_zombie(pid):
            return True
        time.sleep(0.05)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _grandchild_pid(log: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.strip():
            return int(text.split()[0])
        time.sleep(0.05)
    raise AssertionError(f"no pid in {log}")


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_stop_children_ends_the_whole_process_group(tmp_path, mode):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    child = Child(name="c", argv=[sys.executable, str(script), mode], log=tmp_path / "c.log")
    child.start(dict(os.environ))
    grandchild = _grandchild_pid(child.log)
    assert os.getpgid(grandchild) == child.pid  # the grandchild is in the child's group
    stop_children([child], grace_s=0.5 if mode == "stubborn" else 30)
    assert child.poll() is not None
    assert _wait_gone(grandchild), "grandchild survived"


# A child and grandchild that both ignore SIGTERM; the grandchild holds touched memory, so that
# after a SIGKILL it takes longer to exit than its parent (freeing its pages).
HEAVY_TREE = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "held = b'x' * (384 << 20); print('ready', flush=True); time.sleep(600)"
    g = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert g.stdout.readline().strip() == "ready"
    print(g.pid, flush=True)
    time.sleep(600)
    """
)


def test_stop_children_returns_once_a_killed_group_is_gone(tmp_path):
    """After the grace, SIGKILL; stop_children returns only when no process of the group is
    left, not when the direct child is reaped (its grandchild may still be exiting), so a caller
    that looks for leftovers right after finds none."""
    script = tmp_path / "heavy.py"
    script.write_text(HEAVY_TREE)
    child = Child(name="c", argv=[sys.executable, str(script)], log=tmp_path / "c.log")
    child.start(dict(os.environ))
    grandchild = _grandchild_pid(child.log, timeout_s=60)
    assert os.getpgid(grandchild) == child.pid
    stop_children([child], grace_s=0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(child.pid, 0)  # not even a zombie is left in the group


def test_a_killed_launcher_leaves_no_child(tmp_path):
    """SIGKILL of the launcher itself: PR_SET_PDEATHSIG makes its child exit, and the child's group."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    fake_launcher = tmp_path / "launcher.py"
    fake_launcher.write_text(
        textwrap.dedent(
            f"""
            import os, sys, time
            sys.path.insert(0, {str(ROOT)!r})
            from pathlib import Path
            from asyncrl.launch.children import Child
            c = Child(name="c", argv=[sys.executable, {str(script)!r}, "polite"], log=Path({str(tmp_path / "c.log")!r}))
            c.start(dict(os.environ))
            print(c.pid, flush=True)
            time.sleep(600)
            """
        )
    )
    p = subprocess.Popen([sys.executable, str(fake_launcher)], stdout=subprocess.PIPE, text=True)
    child_pid = int(p.stdout.readline())
    grandchild = _grandchild_pid(tmp_path / "c.log")
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert _wait_gone(child_pid)
    # The direct child got SIGTERM from the kernel. Its own children are its duty (torchrun and the
    # rollout worker stop theirs on SIGTERM); this stand-in does not, so clean its group up here.
    try:
        os.killpg(child_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert _wait_gone(grandchild)


def test_sigusr1_dumps_the_launchers_and_each_childs_stacks_and_the_run_goes_on(tmp_path, capfd):
    """What tools/gpu/check.sh sends before it kills a step: `asyncrl run`'s launcher writes its
    own stacks and passes SIGUSR1 to each child's group (each has its own), whose asyncrl processes
    (asyncrl.stacks' registration, here in a real child process) write theirs to their logs and go
    on."""
    go = tmp_path / "go"
    code = (
        "import pathlib, time; from asyncrl.stacks import dump_stacks_on_usr1\n"
        "dump_stacks_on_usr1()\n"
        "print('ready', flush=True)\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
    )
    child = Child(name="learner", argv=[sys.executable, "-c", code], log=tmp_path / "c.log")
    sent = []

    def tick() -> None:
        text = child.log.read_text() if child.log.exists() else ""
        if "ready" in text and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)
        if "most recent call first" in text:
            go.touch()

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    (tmp_path / "logs").mkdir()
    outcome, failed = launch.children.supervise(
        [child],
        env=env,
        run_dir=tmp_path,
        max_restarts=0,
        deadline=time.monotonic() + 60,
        tick=tick,
    )
    assert outcome == "completed" and failed is None  # the child went on, then ended by itself
    assert "in <module>" in child.log.read_text()  # its stack, at the line it was waiting on
    assert (
        "test_sigusr1_dumps" in capfd.readouterr().err
    )  # the launcher's own, with this test in it
    assert signal.getsignal(signal.SIGUSR1) is not None  # the launcher's handler is given back


def _exited(child: Child, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := child.poll()) is None:
        assert time.monotonic() < deadline, f"{child.name} did not exit"
        time.sleep(0.02)
    return code


def test_a_dead_child_is_restarted_until_its_restarts_run_out(tmp_path, capsys):
    """A crash (exit 1, or a signal) is restarted with the restart arguments, its grandchildren
    killed first; exit 2 (a user's mistake) and a child out of restarts end the run."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import subprocess, sys\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(g.pid, sys.argv[1:], flush=True)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    (tmp_path / "logs").mkdir()
    crash = Child(
        name="crash",
        argv=[sys.executable, str(script), "1"],
        log=tmp_path / "c.log",
        restart_args=["run.resume=true"],
    )
    usage = Child(name="usage", argv=[sys.executable, str(script), "2"], log=tmp_path / "u.log")
    crash.start(dict(os.environ))
    grandchild = _grandchild_pid(crash.log)
    assert _exited(crash) == 1
    assert restart_the_dead([crash], 1, dict(os.environ), tmp_path) is None
    assert crash.restarts == 1 and _wait_gone(grandchild)  # its group was cleaned up first
    assert json.loads((tmp_path / "logs/pids.json").read_text()) == {"crash": crash.pid}
    assert _exited(crash) == 1
    log = crash.log.read_text()
    assert "exited with code 1; restart 1 ---" in log and "['1', 'run.resume=true']" in log
    assert restart_the_dead([crash], 1, dict(os.environ), tmp_path) is crash  # out of them
    assert (
        "crash exited with code 1; restarting it (1 of run.max_restarts=1)"
        in capsys.readouterr().err
    )
    usage.start(dict(os.environ))
    assert _exited(usage) == 2
    assert restart_the_dead([usage], 3, dict(os.environ), tmp_path) is usage
    assert usage.restarts == 0
    # exit 0: the learner's ends the run (the caller's business), a worker's is a death
    done = [
        Child(name=n, argv=[sys.executable, str(script), "0"], log=tmp_path / f"{n}.log")
        for n in ("learner", "worker")
    ]
    done[0].finishes_run = True
    for c in done:
        c.start(dict(os.environ))
        assert _exited(c) == 0
    assert restart_the_dead(done[:1], 3, dict(os.environ), tmp_path) is None
    assert restart_the_dead(done, 3, dict(os.environ), tmp_path) is done[1]
    assert done[0].restarts == done[1].restarts == 0
    # ... until the learner has announced the end (learner.json): then it is the worker's end
    info = learner_info.LearnerInfo(
        buffer_address="ipc:///b",
        pub_address="ipc:///p",
        weights_master="127.0.0.1:0",
        rollout_command="asyncrl rollout r.yaml",
        host="h",
        pid=1,
        version=3,
        started_at=time.time(),
    )
    info.write(tmp_path)
    assert restart_the_dead(done, 3, dict(os.environ), tmp_path) is done[1]
    info.ended_at = time.time()
    info.write(tmp_path)
    assert restart_the_dead(done, 3, dict(os.environ), tmp_path) is None
    assert done[1].restarts == 0
    for c in (crash, usage, *done):
        c.signal_group(signal.SIGKILL)


def _recipe(tmp_path, tiny_qwen3, *extra):
    return recipe.load(
        ROOT / "recipes/demo.yaml",
        [f"model.path={tiny_qwen3}", "data.path=", "data.eval_path=", *extra],
    )


def test_plan_one_learner_and_the_workers(tmp_path, tiny_qwen3):
    r = _recipe(tmp_path, tiny_qwen3, "rollout.workers=2", f"run.output_dir={tmp_path}")
    plan = make_plan(r, ROOT / "recipes/demo.yaml", ["run.steps=3"], tmp_path)
    names = [c.name for c in plan.children]
    assert names == ["learner", "rollout0", "rollout1"]
    learner = plan.children[0].argv
    assert learner[1:4] == ["-m", "asyncrl.cli", "learner"] and "run.steps=3" in learner
    assert plan.buffer_address == f"ipc://{tmp_path / 'buffer.ipc'}"
    assert f"buffer.address={plan.buffer_address}" in learner
    rollout = plan.children[1].argv
    assert rollout[rollout.index("--buffer") + 1] == plan.buffer_address
    assert rollout[rollout.index("--pub") + 1] == plan.pub_address


def test_plan_uses_torchrun_for_several_ranks_and_no_workers_for_sft(tmp_path, tiny_qwen3):
    r = _recipe(tmp_path, tiny_qwen3, "learner.ranks=2", "algorithm.loss=sft")
    plan = make_plan(r, ROOT / "recipes/demo.yaml", [], tmp_path)
    assert [c.name for c in plan.children] == ["learner"]
    argv = plan.children[0].argv
    assert "torch.distributed.run" in argv and "--nproc-per-node=2" in argv


def test_explicit_addresses_are_kept(tmp_path, tiny_qwen3):
    r = _recipe(tmp_path, tiny_qwen3, "buffer.address=tcp://127.0.0.1:5555")
    plan = make_plan(r, ROOT / "recipes/demo.yaml", [], tmp_path)
    assert plan.buffer_address == "tcp://127.0.0.1:5555"


def test_existing_run_folder_needs_resume_or_overwrite(tmp_path, tiny_qwen3):
    r = _recipe(tmp_path, tiny_qwen3, f"run.output_dir={tmp_path}")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo/metrics.jsonl").write_text("{}\n")
    with pytest.raises(launch.LaunchError, match="run.resume=true"):
        prepare_run_dir(r, overwrite=False)
    r.run.resume = True
    assert (prepare_run_dir(r, overwrite=False) / "metrics.jsonl").exists()
    r.run.resume = False
    assert not (prepare_run_dir(r, overwrite=True) / "metrics.jsonl").exists()


def test_metrics_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = progress.MetricsTail(path)
    tail.update()  # no file yet: nothing, no error
    smax, reward = metric_names.STALENESS_MAX, metric_names.REWARD_MEAN
    with path.open("w") as f:
        f.write(json.dumps({"step": 1, smax: 2, reward: 0.25}) + "\n")
        f.write(f'{{"step": 2, "{smax}": 3')
    tail.update()
    assert tail.max_staleness_seen == 2 and tail.get(reward) == 0.25
    with path.open("a") as f:
        f.write(f', "{reward}": 0.5}}\n')
    tail.update()
    assert tail.max_staleness_seen == 3 and tail.get(reward) == 0.5


def test_cli_bad_recipe_is_one_line(tmp_path, capsys):
    assert launch.main([str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "recipe file not found" in err and "Traceback" not in err


def _classify(url: str, text: str) -> float:
    import urllib.request

    req = urllib.request.Request(
        url + "/classify",
        data=json.dumps({"text": [text]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())[0]["embedding"][0]


@pytest.mark.slow
def test_reward_model_servers_start_healthy_serve_classify_and_restart_on_their_port(
    tmp_path, tiny_qwen3, tiny_reward_model
):
    """rollout.reward_model.path: `asyncrl run` starts `servers` built-in engines on it before the
    learner and the workers, healthy, and hands their urls (not the path) to both; one killed is
    restarted by the supervisor on the same port, so the urls the workers hold stay right."""
    from asyncrl.generator_http import healthy, sync_client
    from asyncrl.launch.model_servers import server_children, start_servers, url_overrides
    from asyncrl.served.model_reward import build_reward

    r = _recipe(
        tmp_path,
        tiny_qwen3,
        f"run.output_dir={tmp_path}",
        "rollout.reward=model",
        f"rollout.reward_model.path={tiny_reward_model}",
        "rollout.reward_model.servers=2",
    )
    run_dir = prepare_run_dir(r, overwrite=False)
    children = server_children(r, run_dir, tmp_path)
    assert [c.name for c in children] == ["reward_model0", "reward_model1"]
    env = {**os.environ, **launch.CHILD_ENV}
    http = sync_client(2.0)
    try:
        urls = start_servers(children, env, timeout_s=120.0)
        assert len(set(urls)) == 2 and all(healthy(http, u) for u in urls)
        scores = [_classify(u, "dcab=abcd") for u in urls]
        assert scores[0] == pytest.approx(scores[1], abs=1e-6)  # the same model behind both
        # the learner and the worker get the urls and no path: their recipe loads, and scores
        plan = make_plan(r, ROOT / "recipes/demo.yaml", url_overrides(children, urls), tmp_path)
        for child in plan.children:
            given = [a for a in child.argv if a.startswith("rollout.reward_model.")]
            seen = recipe.load(
                ROOT / "recipes/demo.yaml",
                [f"model.path={tiny_qwen3}", "data.path=", "data.eval_path=", *given],
            )
            assert seen.rollout.reward_model.urls == urls and seen.rollout.reward_model.path == ""
            build_reward(seen)  # no "needs urls" error
        # killed: restarted (as any child) on the port the workers know
        port = urls[0].rsplit(":", 1)[1]
        assert children[0].argv[children[0].argv.index("--port") + 1] == port
        children[0].signal_group(signal.SIGKILL)
        _exited(children[0])
        assert restart_the_dead(children, 1, env, run_dir) is None
        assert children[0].restarts == 1
        deadline = time.monotonic() + 120.0
        while not healthy(http, urls[0]):
            assert children[0].poll() is None, children[0].tail()
            assert time.monotonic() < deadline, "the restarted server never answered /health"
            time.sleep(0.2)
        assert _classify(urls[0], "dcab=abcd") == pytest.approx(scores[0], abs=1e-6)
    finally:
        http.close()
        stop_children(children, grace_s=10.0)
    assert all(c.poll() is not None for c in children)


def test_a_reward_model_server_that_cannot_start_is_named_with_its_log(tmp_path, tiny_qwen3):
    """A server that exits while starting stops the launch with its name and its log's tail."""
    from asyncrl.launch.model_servers import server_children, start_servers

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text('{"architectures": ["Qwen3ForSequenceClassification"]}')
    r = _recipe(
        tmp_path,
        tiny_qwen3,
        f"run.output_dir={tmp_path}",
        "rollout.reward=model",
        f"rollout.reward_model.path={rm}",
    )
    children = server_children(r, prepare_run_dir(r, overwrite=False), tmp_path)
    env = {**os.environ, **launch.CHILD_ENV}
    with pytest.raises(launch.LaunchError, match="reward_model0 .* exited with code") as e:
        start_servers(children, env, timeout_s=120.0)
    assert "reward_model0.log" in str(e.value)
    assert all(c.poll() is not None for c in children)


def test_a_causal_lm_as_reward_model_is_refused_before_anything_starts(
    tmp_path, tiny_qwen3, capsys
):
    argv = [
        str(ROOT / "recipes/demo.yaml"),
        f"model.path={tiny_qwen3}",
        "data.path=",
        "data.eval_path=",
        f"run.output_dir={tmp_path}",
        "rollout.reward=model",
        f"rollout.reward_model.path={tiny_qwen3}",
    ]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert "rollout.reward_model.path" in err and "not a sequence-classification" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_the_teachers_servers_are_children_beside_the_reward_models_and_get_their_own_urls(
    tmp_path, tiny_qwen3, tiny_reward_model
):
    """rollout.teacher.path is served as rollout.reward_model.path is: `servers` engines on it,
    named after their section; each section's urls replace its path in the children's recipe,
    which the learner and the workers then load (the teacher client built, no "needs urls")."""
    from asyncrl.launch.model_servers import server_children, url_overrides
    from asyncrl.served.teacher import build_teacher

    r = _recipe(
        tmp_path,
        tiny_qwen3,
        f"run.output_dir={tmp_path}",
        "buffer.dynamic_sampling=false",
        "algorithm.advantage=distill",
        f"rollout.teacher.path={tiny_qwen3}",
        "rollout.teacher.servers=2",
        "rollout.teacher.batch_size=7",
        f"rollout.reward_model.path={tiny_reward_model}",
    )
    children = server_children(r, prepare_run_dir(r, overwrite=False), tmp_path)
    assert [c.name for c in children] == ["reward_model0", "teacher0", "teacher1"]
    teacher = children[1].argv
    assert teacher[teacher.index("--model") + 1] == str(tiny_qwen3.resolve())
    assert teacher[teacher.index("--max-batch-size") + 1] == "7"
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    given = url_overrides(children, urls)
    assert given == [
        'rollout.reward_model.urls=["http://127.0.0.1:1"]',
        "rollout.reward_model.path=",
        'rollout.teacher.urls=["http://127.0.0.1:2", "http://127.0.0.1:3"]',
        "rollout.teacher.path=",
    ]
    with pytest.raises(recipe.RecipeError, match="needs their urls"):
        build_teacher(r)  # the path alone: a process started without `asyncrl run`
    seen = _recipe(
        tmp_path,
        tiny_qwen3,
        "buffer.dynamic_sampling=false",
        "algorithm.advantage=distill",
        f"rollout.teacher.path={tiny_qwen3}",
        *given,
    )
    client = build_teacher(seen)
    assert client is not None and client.urls == urls[1:]
