# revtrain: one-command set-up, training, tests and benchmarks.
#   make train [WORKDIR=runs/enwik_small] [CONFIG=configs/enwik_small.gin]
#   make test
#   make bench

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/enwik_small
CONFIG ?= configs/enwik_small.gin
GIN ?=

.PHONY: venv data train eval test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

data: venv
	$(PY) scripts/prepare_data.py

train: data
	$(VENV)/bin/revtrain train --config $(CONFIG) --workdir $(WORKDIR) $(GIN)
	$(VENV)/bin/revtrain eval --workdir $(WORKDIR)

eval: venv
	$(VENV)/bin/revtrain eval --workdir $(WORKDIR)

test: data
	$(PY) -m pytest -q tests

bench: data
	$(PY) scripts/benchmark.py

clean:
	rm -rf $(VENV) runs bench.json bench.png
