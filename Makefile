# Two commands: `make run` and `make test`. Both create .venv and install the project first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.kvtier-installed
# torch is pinned to the CPU build that lies on this machine's disk; a plain `torch` pulls GBs of CUDA wheels.
TORCH   ?= torch==2.13.0

.PHONY: run test venv lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VPY) -m kvtier.mainjob

test: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/kvtier bench tiers --json out/bench_tiers.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache out
