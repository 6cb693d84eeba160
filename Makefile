# asyncrl's own environment lives in .venv at the repository root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-default test-kernels test-faults test-sglang gpu-host-check lint format demo demo-rlhf demo-distill demo-lora demo-agent demo-moe bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first (it lies on local disk); an unpinned torch would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Tests run in WORKERS processes (pytest-xdist; 2, this kind of machine's cores). Most tests start
# processes and wait on them, so two at a time take the suite 1.3x (default tier) to 1.6x (faults)
# less wall time on 2 cores (BENCHMARKS.md, Session 18). WORKERS=0 runs them in this process, one by
# one. The SGLang tier stays serial: its servers are shared, and the tests that kill one go last.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist worksteal

test: test-default
	$(MAKE) --no-print-directory test-kernels

# The default tier alone: every test not marked sglang or faults (`make test` runs it, then the
# numerics tier under another CPU's kernels; tools/ci/soak.py repeats it by itself).
test-default: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(XDIST) --durations=15

# The numerics tier once more under the kernels of the other x86 CPU this kind of machine may be
# (tests/numerics.py): a CI machine may be an AVX-512 or an AVX2-only Intel or AMD, and a float32
# tolerance chosen on one failed on another twice. torch's ATen kernels, oneDNN and MKL each pick
# their instruction set at run time; these variables force another one, on any x86 machine. One
# pass, not two: on an AVX-512 CPU the AVX2 paths are the other machine's own kernels (a CI failure on
# an AVX2-only EPYC was reproduced by them to the last digit); on an AVX2 CPU, which cannot run
# AVX-512 kernels, the generic paths stand in for "other kernels, other summation orders". The
# generic paths on an AVX-512 CPU were a second stand-in, for kernels no machine of this kind runs:
# 5.5 min of CI for nothing the AVX2 pass does not test (BENCHMARKS.md, Session 22).
KERNELS_AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
KERNELS_GENERIC := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-kernels: $(STAMP)
	@set -e; native=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"); \
	if [ "$$native" = AVX2 ]; then name=generic; vars="$(KERNELS_GENERIC)"; else name=avx2; vars="$(KERNELS_AVX2)"; fi; \
	echo "numerics tier on the $$name kernel paths ($$vars; this CPU's own: $$native)"; \
	env $$vars OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(XDIST) -m numerics -p no:cacheprovider

# The faults tier (RELIABILITY.md): tests/faults (SIGKILLed workers, learner, engines; hostile
# input to the buffer; broken rewards, tools, data; two hosts in network namespaces, as root, with
# their link cut, lossy or half-open), the weights' SIGKILL-mid-update test, and the
# longer variants of a few default tests (an RL run's Ctrl-C, learner + rollout over mutual TLS).
test-faults: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(XDIST) -m faults tests

# The real-SGLang tier (README "Tests against real SGLang"): builds SGLang 0.5.23's own venv once
# (tools/sglang_cpu/build_env.sh, cached in ~/.cache/asyncrl), serves tiny models with it on CPU and
# drives them with asyncrl's rollout client and weight broadcaster. ASYNCRL_SKIP_SGLANG=1 skips it.
test-sglang: $(STAMP)
	@if [ "$${ASYNCRL_SKIP_SGLANG:-0}" = 1 ]; then echo "sglang tier: skipped (ASYNCRL_SKIP_SGLANG=1)"; exit 0; fi; \
	bash tools/sglang_cpu/build_env.sh >/dev/null || { echo "error: the SGLang CPU environment cannot be built (tools/sglang_cpu/build_env.sh, output above); ASYNCRL_SKIP_SGLANG=1 switches this tier off" >&2; exit 1; }; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m sglang tests/sglang

# The GPU check's dry run in an environment like the lent GPU host's (docs/gpu.md, "Before GPU time:
# the host-like environment"): Python 3.12 and torch 2.11.0 from PyPI (a venv cached in
# ~/.cache/asyncrl, 4.9 GB), the wheel bundle and the torch shim put in as check.sh puts them there,
# then check.sh --dry once per attention that runs on CPU (sdpa, flex) and TorchTitan's flex forward.
# Not part of `make test`. RESULTS=dir keeps the records (default: a temporary folder).
gpu-host-check:
	OMP_NUM_THREADS=1 bash tools/gpu/host_env.sh $(RESULTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The CPU demo (README): a tiny Qwen3 learns to sort letters by asynchronous RL, in minutes on 2 cores.
# 1. model + data (tools/make_demo.py), 2. SFT warm start to 10-50% held-out success,
# 3. async GRPO (eta = 4, decoupled PPO); results in runs/demo/ (summary.json, plots/, wandb/).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/make_demo.py
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_sft.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo.yaml --overwrite
	@echo "summary: runs/demo/summary.json   plots: runs/demo/plots/   W&B offline run: runs/demo/wandb/"

# The RLHF demo (README, docs/reward-models.md): the same task, but the RL stage's only reward is a
# learned reward model's score. 1. model + data + preference pairs, 2. SFT warm start (demo_sft),
# 3. reward model on the pairs (right answer over a near miss), 4. async RL on the reward model's score
# (`asyncrl run` serves it); held-out exact match against the ground truth in runs/demo_rlhf/.
demo-rlhf: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/make_demo.py --pairs-dir build/demo-rlhf/pairs --pairs 16000
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_sft.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_rm.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_rlhf.yaml --overwrite
	@echo "summary: runs/demo_rlhf/summary.json   plots: runs/demo_rlhf/plots/ (reward_model.png)   reward model: runs/demo_rm/"

# The on-policy distillation demo (docs/distill.md): the SFT'd student learns from the RL demo's
# final export as a teacher (its logprobs of the student's own samples), with no task reward in the
# loss. 1. model + data, 2. SFT warm start (demo_sft), 3. async GRPO (demo: the teacher, and the
# same budget with GRPO alone), 4. distillation (demo_distill; `asyncrl run` serves the teacher).
demo-distill: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/make_demo.py
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_sft.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_distill.yaml --overwrite
	@echo "summary: runs/demo_distill/summary.json (GRPO alone: runs/demo/summary.json)   plots: runs/demo_distill/plots/"

# The LoRA demo (docs/lora.md): the demo's async GRPO with rank-8 adapters on the frozen SFT'd model;
# only the adapters train and are sent to the engine. 1. model + data, 2. SFT warm start (demo_sft),
# 3. async GRPO with LoRA (demo_lora); runs/demo_lora/hf/latest is a PEFT adapter folder.
demo-lora: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/make_demo.py
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_sft.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_lora.yaml --overwrite
	@echo "summary: runs/demo_lora/summary.json   plots: runs/demo_lora/plots/   adapter: runs/demo_lora/hf/latest/"

# The mixture-of-experts demo (docs/moe.md): the demo's task on a tiny Qwen3-MoE (8 experts, top-2)
# with routing replay: the built-in engine returns each token's experts and the learner trains the
# token through them. 1. model (--arch qwen3_moe) + data, 2. SFT warm start (demo_moe_sft),
# 3. async GRPO with routing replay (demo_moe); summary.json has the routing agreement; 4. the same
# stage without replay (demo_moe_noreplay), and the two side by side (tools/moe_replay_summary.py).
demo-moe: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/make_demo.py --arch qwen3_moe --out build/demo_moe
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_moe_sft.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_moe.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_moe.yaml --overwrite run.name=demo_moe_noreplay algorithm.routing_replay=false
	@$(BIN)/python tools/moe_replay_summary.py runs
	@echo "summaries: runs/demo_moe{,_noreplay}/summary.json   plots: runs/demo_moe/plots/"

# The agent demo (docs/agents.md): the tiny Qwen3 learns to call a tool, served over MCP (stdio, one
# `python -m asyncrl.agents.demo_agent` per episode), to answer lookups it cannot know. 1. model +
# data, 2. SFT warm start (the tool called for some keys), 3. async GRPO with the multi_turn workflow;
# runs/demo_agent/summary.json: held-out success and tool-call rate at the start and the end.
demo-agent: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/make_demo.py --task lookup --out build/demo_agent
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_agent_sft.yaml --overwrite
	OMP_NUM_THREADS=1 $(BIN)/asyncrl run recipes/demo_agent.yaml --overwrite
	@echo "summary: runs/demo_agent/summary.json   plots: runs/demo_agent/plots/   W&B offline run: runs/demo_agent/wandb/"

clean:
	rm -rf $(VENV) build *.egg-info
