# Set-up on a fresh machine is `make serve` or `make test`: both create .venv and install from pyproject.toml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install install-aot serve test test-engine test-server test-models test-cpu-rest test-compile test-slow \
	plan-targets peers clean

%/bin/python:  # a venv: .venv, .venv-aot
	$(PYTHON) -m venv $*
	$*/bin/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The compile tier's own venv (the "aot" extra: CUDA plugin + nvcc, libtpu): the kernels are compiled for H200 and
# TPU v5e/v5p/v6e on this CPU host. Kept out of .venv, whose CPU runtime must not see the CUDA plugin.
AOT_VENV := .venv-aot
AOT_BIN := $(AOT_VENV)/bin
AOT_STAMP := $(AOT_VENV)/.installed

$(AOT_STAMP): pyproject.toml | $(AOT_BIN)/python
	$(AOT_BIN)/python -m pip install --quiet -e '.[aot]'
	touch $(AOT_STAMP)

install-aot: $(AOT_STAMP)

serve: $(STAMP)
	$(BIN)/jaxserve serve

# Five parts, two at a time, one per core of the CI host (`make -j2`, each part's output printed whole when it ends),
# longest first so the last to start are the short ones: the engine tests (35 min alone on one lane), the HTTP
# server tests (15 min), the compile tier (10 min), the kernel and model tests (15 min), the other CPU tests (6 min,
# converter and bench included, taken by the engine's lane when it ends: one lane of four parts left the other idle
# 9 min, and with the converter and bench tests in the kernels' part the engine's lane still ended 4 min first). The
# server tests compile their engines in a fresh process: late XLA compiles crashed twice in one long process
# (likely the 65,530 memory-mapping limit: every live executable holds mappings; tests/conftest.py drops each
# module's programs).
CPU_TESTS = $(BIN)/python -m pytest -q --durations=10 $(PYTEST_ARGS)
test: $(STAMP) $(AOT_STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-engine test-server test-compile test-models \
		test-cpu-rest

test-engine: $(STAMP)
	$(CPU_TESTS) tests/engine

test-server: $(STAMP)
	$(CPU_TESTS) tests/server

MODEL_TESTS = tests/kernels tests/models
test-models: $(STAMP)
	$(CPU_TESTS) $(MODEL_TESTS)

test-cpu-rest: $(STAMP)
	$(CPU_TESTS) --ignore=tests/engine --ignore=tests/server --ignore=tests/compile $(MODEL_TESTS:%=--ignore=%)

# Real compiles (not lowerings) of every Pallas kernel for H200 and TPU v5e/v5p/v6e, in .venv-aot; with
# JAXSERVE_COMPILE_TIER=1 a missing compiler fails the run instead of skipping it. JAX_PLATFORMS=cpu: the CUDA
# plugin must not look for a driver.
COMPILE_TIER = JAX_PLATFORMS=cpu JAXSERVE_COMPILE_TIER=1 $(AOT_BIN)/python -m pytest -q --durations=10 tests/compile
test-compile: $(AOT_STAMP)
	$(COMPILE_TIER)

# README's real-size target table: `jaxserve plan --target` for 8 x H200, TPU v5p (8 chips) and v6e (32 chips, the
# smallest slice that fits), each timed with the host's load (bench/plan_timed.py: 9-25 min each for GLM-5.2 here).
PLAN_MODELS := kimi-k2.6 glm-5.2
plan-targets: $(AOT_STAMP)
	for t in h200:8 v5p:8 v6e:32; do for m in $(PLAN_MODELS); do \
		$(AOT_BIN)/python bench/plan_timed.py bench/results/plan_$${t%:*}_$$(echo $$m | sed "s/\.//; s/-/_/g").json \
			--preset $$m --devices $${t#*:} --target $${t%:*} || exit 1; done; done
	$(AOT_BIN)/python bench/plan_timed.py bench/results/plan_h100_kimi_k26.json --preset kimi-k2.6 --devices 8 --target h100
	$(AOT_BIN)/python bench/plan_timed.py bench/results/plan_h200_kimi_k26_dp.json --preset kimi-k2.6 --devices 8 \
		--target h200 --attention dp
	$(AOT_BIN)/python bench/plan_timed.py bench/results/plan_v6e_kimi_k26_ep.json --preset kimi-k2.6 --devices 32 \
		--target v6e --sharding ep

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# The bench's optional CPU peers (the "peers" extra; `make test` does not install it: the build takes minutes).
# llama-cpp-python is built from its source here with CPU-only, -march=native flags: the peer should run as fast
# as llama.cpp can on this CPU (AVX-512 etc.), and no GPU toolkit found on the machine may change what is measured.
# Its source distribution also ships llama.cpp's GGUF converter, unpacked under .cache/peers/ for the bench.
LLAMA_CPP_VERSION := 0.3.36
PEERS_CACHE := .cache/peers
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_HIP=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
	-DGGML_BLAS=OFF -DLLAVA_BUILD=OFF
peers: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --no-binary llama-cpp-python -e '.[test,peers]'
	$(BIN)/python -m pip download --quiet --no-binary :all: --no-deps -d $(PEERS_CACHE) \
		llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar -xzf $(PEERS_CACHE)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(PEERS_CACHE)

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .hypothesis
