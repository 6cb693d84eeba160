"""`asyncrl engine` as a child process: port 0 + port file, /health, clean stop, clear CLI errors."""

from __future__ import annotations

import subprocess
import sys

import httpx

from asyncrl.rollout.engine import start_engine_process


def test_start_engine_process_serves_and_stops(tiny_llama):
    ep = start_engine_process(tiny_llama, port=0, weight_version="v0", timeout_s=120)
    try:
        assert ep.port > 0 and ep.alive()
        info = httpx.get(ep.url + "/model_info", timeout=30).json()
        assert info["weight_version"] == "v0" and info["architectures"] == ["LlamaForCausalLM"]
        r = httpx.post(
            ep.url + "/generate",
            json={"text": "hi", "sampling_params": {"max_new_tokens": 3}},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    finally:
        code = ep.stop()
    assert code == 0 and not ep.alive()


def test_cli_rejects_a_missing_model_folder(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "engine",
            "--model",
            str(tmp_path / "nope"),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "not a HuggingFace model folder" in r.stderr and "Traceback" not in r.stderr
