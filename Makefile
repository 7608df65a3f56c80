# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv (Python 3.11) and install everything they need.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-dev
PYTEST  ?= -q --durations=15

.PHONY: help venv demo test test-main test-fast test-vllm test-megatron lint bench soak docs clean

help:
	@echo "make demo       run the main job (dcr demo) in .venv; ARGS=--faults injects failures"
	@echo "make test       lint, type-check and run the whole suite (incl. heavy, vLLM, Megatron)"
	@echo "make test-fast  the suite without heavy cases and without vLLM"
	@echo "make bench      dcr bench codec, construct, apply, dense, proof, relay, refit, project (JSON to out/)"
	@echo "make soak       a long fleet run: random SIGKILLs of every role, SOAK_REFITS refits"
	@echo "make docs       regenerate generated docs (protocol state diagram)"

# setup.py and the C source: a changed kernel is rebuilt by the editable install.
$(STAMP): pyproject.toml setup.py dcr/_kernels.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/dcr demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check dcr tests
	$(BIN)/mypy dcr

# DCR_REQUIRE_NATIVE=1: the C kernels must have been built (tests/test_native.py checks).
test-main: lint
	DCR_REQUIRE_NATIVE=1 $(BIN)/python -m pytest $(PYTEST)

test-fast: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST) -m "not heavy"

test-vllm:
	scripts/vllm-venv.sh
	.venv-vllm/bin/python -m pytest $(PYTEST) tests/vllm

test-megatron:
	scripts/megatron-venv.sh
	.venv-megatron/bin/python -m pytest $(PYTEST) tests/megatron

test: test-main test-vllm test-megatron

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
