# revtrain: one-command set-up, training, tests and benchmarks.
#   make train [CONFIG=configs/enwik_modern.gin] [WORKDIR=runs/<the config's name>]
#   make data [CONFIG=...]   (the data of CONFIG only)
#   make smoke  (first: both trainers bit for bit, then train, eval and sample; 25-40 s once the data is prepared)
#   make test   (make test-all: with the slow scenario tests)
#   make bench   make bench-gpu
#   make bench-depth
#   make bench-budget
#   make bench-long
#   make bench-recipe
#   make bench-scale [SIZES=25M,57M,136M,309M,1.44B,3B]
#   make sample [WORKDIR=...] [PROMPT='[[Category:']   make bench-sample   make check-sample
#   make train-revnet   make train-revvit   (Fashion-MNIST: a RevNet, a reversible ViT)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/enwik_modern.gin
WORKDIR ?= runs/$(basename $(notdir $(CONFIG)))
GIN ?=

.PHONY: venv data train eval smoke test test-all bench bench-gpu bench-depth bench-budget bench-long bench-recipe bench-scale clean sample bench-sample check-sample

# (setuptools warns on every editable install of a flat layout that a folder named like the package could
# shadow it; this checkout's revtrain/ is the package itself, so that notice is filtered out)
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The data of CONFIG (its train.task: for enwik_bpe.gin the corpus tokenized with its BPE), one line saying
# what was prepared (how much, how long) or found in the cache.
data: venv
	$(PY) scripts/prepare_data.py --config $(CONFIG) $(GIN)

train: data
	$(VENV)/bin/revtrain train --config $(CONFIG) --workdir $(WORKDIR) $(GIN)
	$(VENV)/bin/revtrain eval --workdir $(WORKDIR) --split test

eval: venv
	$(VENV)/bin/revtrain eval --workdir $(WORKDIR)

# What a newcomer runs first, and what shows that a change did not break training (tests/test_smoke.py): its
# two tests (both trainers bit for bit; train, eval and sample through the CLI) in two processes at once.
smoke: data
	$(PY) -m pytest -q -n 2 tests/test_smoke.py

# Two test processes (pytest-xdist; a file's tests stay in one process). make test leaves out the tests
# marked slow (long multi-process scenarios); make test-all runs every test.
TEST_WORKERS ?= 2
test: data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" --durations=15 tests

test-all: data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Standard, remat (scan + jax.checkpoint, also with offloaded inputs), reversible (exact, fused and fenced
# rebuild; exact and fused also with offload; fused with fuse_top) at depths 2, 8 and 32, then an
# activation-dominated point (depth 32, T 4,096, blockwise attention; one step each): bench.json, bench.png
# and the table of README; then the recipe rows (clip_by_global_norm, 4 microbatches).
bench: data
	$(PY) scripts/bench_trainers.py --depths 2,8,32
	$(PY) scripts/bench_recipe.py --out bench_recipe.json

# The recipe (docs/recipe.md): clip_by_global_norm + AdamW and 4 microbatches against the fused update, time
# (interleaved rounds) and peak device bytes, at the default run's model size.
bench-recipe: data
	$(PY) scripts/bench_recipe.py --out bench_recipe.json

# Host memory at scale (docs/memory.md): a ladder of Llama-style byte models (25 M ... 1.44 B parameters with
# AdamW and Adafactor, 3 B with Adafactor), each of StandardTrainer, ReversibleTrainer and ReversibleTrainer +
# offload in its own processes under the memory plan: train 3 steps with a checkpoint every 2, resume to 5,
# eval; peak RSS by phase, bytes per parameter, seconds per step and per checkpoint, the plan's estimate.
# A size the plan refuses is recorded, and the trainer's larger sizes skipped. bench_scale.json, .png, a table.
# The 1.44 B and 3 B points need about 18 GiB: run them on an otherwise idle machine.
SIZES ?= 25M,57M,136M,309M,1.44B,3B
bench-scale: data
	$(PY) scripts/bench_scale.py --sizes $(SIZES) --out bench_scale.json

# On a machine with one GPU: every GPU figure, each configuration in its own process, JSON out (<= 8 min).
# DRY_RUN=1 make bench-gpu runs every configuration at tiny sizes on the CPU. Without a venv (the GPU image:
# its own JAX, no network) it runs on PYTHON, with the carried wheels and data (docs/gpu.md): nothing installed.
bench-gpu:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/gpu_report.sh gpu_report.json

# Tokens/s against the device-memory budget (docs/budget.md): standard, remat, remat + offload, reversible
# exact and fused, and ReversibleTrainer.memory_budget at budgets from exact's peak to standard's, depths 8 and
# 32 (d_model 256, T 512, batch 8): bench_budget.json, .png and a table. Needs both cores for a while.
bench-budget: data
	$(PY) scripts/bench_budget.py --depths 8,32

# Steps/s and start-up time against depth (8..256 tiny blocks) for both executors of both trainers.
bench-depth: data
	$(PY) scripts/bench_depth.py

# Blockwise vs dense attention against the sequence length (T = 512 ... 65,536; the longest points are one
# step each, and T = 65,536 takes a while on a CPU): bench_long.json, bench_long.png and a table.
bench-long: data
	$(PY) scripts/bench_seq.py

PROMPT ?= [[Category:
sample: venv
	$(VENV)/bin/revtrain sample --workdir $(WORKDIR) --prompt '$(PROMPT)'

# Cached decoding against recomputing the prefix for every byte (default model, 512 bytes).
bench-sample: venv
	$(PY) scripts/bench_sample.py

# On a trained run of configs/enwik_small.gin (trained here first, about 10 minutes, unless SAMPLE_WORKDIR
# already holds the finished run): the greedy continuation of '[[Category:' closes with ']]'.
SAMPLE_WORKDIR ?= runs/enwik_small
check-sample: data
	$(VENV)/bin/revtrain train --config configs/enwik_small.gin --workdir $(SAMPLE_WORKDIR)
	REVTRAIN_SAMPLE_WORKDIR=$(SAMPLE_WORKDIR) $(PY) -m pytest -q tests/test_sample.py -k closes_category_links

clean:
	rm -rf $(VENV) runs bench.json bench.png bench_depth.json bench_depth.png bench_long.json bench_long.png \
	  bench_sample.json bench_recipe.json gpu_report.json bench_scale.json bench_scale.png bench_budget.json bench_budget.png

# Fashion-MNIST image classifiers: the RevNet (configs/revnet_fashion_mnist.gin) and the reversible ViT
# (RevViT, configs/revvit_fashion_mnist.gin; docs/modern.md). The data is the Debian package
# dataset-fashion-mnist, installed here when missing and run as root; or any directory holding the four IDX
# files. Each run's own final evaluation is on the test split (evaluate.split = 'test').
#   make train-revnet [FASHION_MNIST_DIR=/dir/with/the/four/idx/files]
#   make train-revvit [FASHION_MNIST_DIR=...] [GIN="--gin 'NUM_LAYERS = 12'"]
# Pretrain a small Llama-style byte LM on enwik, export it, fine-tune it on Python source three ways
# (docs/finetune_python.md).
.PHONY: finetune-python
finetune-python: WORKDIR = runs/finetune_python
finetune-python: data
	bash scripts/finetune_python.sh $(WORKDIR)

.PHONY: train-revnet train-revvit
train-revnet: WORKDIR = runs/revnet_fashion_mnist
train-revnet: CONFIG = configs/revnet_fashion_mnist.gin
train-revvit: WORKDIR = runs/revvit_fashion_mnist
train-revvit: CONFIG = configs/revvit_fashion_mnist.gin
FASHION_MNIST_DIR ?= /usr/share/datasets/fashion-mnist
train-revnet train-revvit: venv
	@if [ ! -d "$(FASHION_MNIST_DIR)" ]; then \
	  if [ "$(FASHION_MNIST_DIR)" != /usr/share/datasets/fashion-mnist ]; then \
	    echo "$(FASHION_MNIST_DIR) does not exist: put the four Fashion-MNIST *-idx*-ubyte.gz files there" >&2; exit 1; \
	  elif [ "$$(id -u)" = 0 ]; then \
	    apt-get update && apt-get install -y dataset-fashion-mnist; \
	  else \
	    echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist' (or 'sudo make $@'), or pass FASHION_MNIST_DIR=/dir/with/the/four/idx/files" >&2; exit 1; \
	  fi; \
	fi
	$(VENV)/bin/revtrain train --config $(CONFIG) --workdir $(WORKDIR) --gin "FashionMNISTTask.source = '$(FASHION_MNIST_DIR)'" $(GIN)
