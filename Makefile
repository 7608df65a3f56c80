# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv (Python 3.11) and install everything they need.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-dev
# Tests run on JOBS pytest-xdist workers (most wait on processes or run single-threaded Python,
# so two workers halve the wall time on a 2-core machine); JOBS=0 runs them in one process.
JOBS    ?= 2
PYTEST  ?= -q --durations=15 -n $(JOBS)
# `make test` leaves out the `deep` cases (the model checker's larger configurations, the long
# fault runs): `make test-deep` runs them.
SHALLOW := -m "not deep"

.PHONY: help venv venv-vllm venv-megatron envs demo demo-fleet test test-main test-fast test-deep test-ray test-vllm test-rl-loop test-megatron lint bench soak docs clean

help:
	@echo "make demo       the RL loop (dcr rl) in .venv-vllm: a dense reference run, then the same"
	@echo "                run refitted by dcr with SIGKILLs, compared step by step; a plot in out/"
	@echo "make demo-fleet the synthetic large-model fleet (dcr demo) in .venv; ARGS=--faults"
	@echo "make test       lint, type-check and run the suite (incl. heavy, vLLM, RL, Megatron; not deep)"
	@echo "make test-fast  the suite without heavy cases and without vLLM"
	@echo "make test-deep  the deep cases make test leaves out: larger model-checker"
	@echo "                configurations and long fault runs (an hour or more)"
	@echo "make test-rl-loop  the RL loop's tests alone (dcr rl with processes and on Ray)"
	@echo "make envs       build .venv, .venv-vllm and .venv-megatron side by side"
	@echo "                (tests run on JOBS=2 pytest-xdist workers; JOBS=0: one process)"
	@echo "make bench      dcr bench codec, construct, apply, dense, proof, relay, refit, project (JSON to out/)"
	@echo "make soak       a long fleet run: random SIGKILLs of every role, SOAK_REFITS refits"
	@echo "make docs       regenerate generated docs (protocol state diagram)"

# setup.py and the C source: a changed kernel is rebuilt by the editable install.  Editable
# installs build the kernels into the source tree, so the three environments' installs of dcr
# take turns (scripts/editable-install.sh).
$(STAMP): pyproject.toml setup.py dcr/_kernels.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	scripts/editable-install.sh $(BIN)/python '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

KERNELS := pyproject.toml setup.py dcr/_kernels.c scripts/editable-install.sh
VLLM_STAMP := .venv-vllm/.dcr-vllm-stamp
MEGATRON_STAMP := .venv-megatron/.dcr-megatron-stamp

$(VLLM_STAMP): scripts/vllm-venv.sh $(KERNELS)
	scripts/vllm-venv.sh

$(MEGATRON_STAMP): scripts/megatron-venv.sh $(KERNELS)
	scripts/megatron-venv.sh

venv-vllm: $(VLLM_STAMP)

venv-megatron: $(MEGATRON_STAMP)

# The three environments are built side by side (each install is mostly one busy core).
envs:
	$(MAKE) --no-print-directory -j3 --output-sync=target venv venv-vllm venv-megatron

# The RL loop: 20 GRPO steps refitted densely (the reference), then the same seeded run
# refitted by dcr while the engine is SIGKILLed mid-refit twice and a trainer rank once.
DEMO_STEPS ?= 20
demo: venv-vllm
	mkdir -p out
	.venv-vllm/bin/dcr rl --steps $(DEMO_STEPS) --refit dense --dir out/rl-dense --json \
		> out/rl-dense.json
	.venv-vllm/bin/dcr rl --steps $(DEMO_STEPS) --faults --dir out/rl-delta \
		--against out/rl-dense.json --plot out/rl.png $(ARGS)

demo-fleet: $(STAMP)
	$(BIN)/dcr demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dcr tests
	$(BIN)/mypy dcr

# DCR_REQUIRE_NATIVE=1: the C kernels must have been built (tests/test_native.py checks).
# LINTED=1: lint already ran (`make test` lints while the other environments build).
test-main: $(if $(LINTED),$(STAMP),lint)
	DCR_REQUIRE_NATIVE=1 $(BIN)/python -m pytest $(PYTEST) $(SHALLOW)

test-fast: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST) -m "not heavy and not deep"

test-deep: $(STAMP) venv-vllm
	$(BIN)/python -m pytest $(PYTEST) -m deep
	.venv-vllm/bin/python -m pytest $(PYTEST) -m deep tests/vllm tests/rl

# Ray binds every interface: its suite runs in a private network namespace with loopback only.
test-ray: $(STAMP)
	unshare -n $(BIN)/python -m dcr.ray.netns $(BIN)/python -m pytest -q --durations=5 tests/ray

# The RL loop's Ray runs enter private network namespaces of their own (unshare -n, as root).
test-vllm: venv-vllm
	.venv-vllm/bin/python -m pytest $(PYTEST) $(SHALLOW) tests/vllm tests/rl

# The RL loop alone: dcr rl with processes and on Ray, the Ray embedding example.
test-rl-loop: venv-vllm
	.venv-vllm/bin/python -m pytest $(PYTEST) $(SHALLOW) tests/vllm/test_rl_loop.py

test-megatron: venv-megatron
	.venv-megatron/bin/python -m pytest $(PYTEST) $(SHALLOW) tests/megatron

test:
	$(MAKE) --no-print-directory -j3 --output-sync=target lint venv-vllm venv-megatron
	$(MAKE) --no-print-directory LINTED=1 test-main test-ray test-vllm test-megatron

bench: $(STAMP)
	mkdir -p out
	$(BIN)/dcr bench codec --json | tee out/bench-codec.json
	$(BIN)/dcr bench codec --floor --json | tee out/bench-codec-floor.json
	$(BIN)/dcr bench construct --json | tee out/bench-construct.json
	$(BIN)/dcr bench apply --json | tee out/bench-apply.json
	$(BIN)/dcr bench dense --json | tee out/bench-dense.json
	$(BIN)/dcr bench proof --json | tee out/bench-proof.json
	$(BIN)/dcr bench relay --json | tee out/bench-relay.json
	$(BIN)/dcr bench refit --json --plot out/bench-refit.png | tee out/bench-refit.json
	$(BIN)/dcr bench project --from out/bench-refit.json --json | tee out/bench-project.json

SOAK_REFITS ?= 60
soak: $(STAMP)
	mkdir -p out
	$(BIN)/dcr demo --faults random --refits $(SOAK_REFITS) --seed 7 --dir out/soak --json \
		| tee out/soak.json

docs: $(STAMP)
	$(BIN)/python scripts/gen_protocol_doc.py

clean:
	rm -rf $(VENV) .venv-vllm .venv-megatron .pytest_cache .mypy_cache .ruff_cache .hypothesis out
