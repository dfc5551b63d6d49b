# Entry points; each target is one command a newcomer can run.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test lint bench-engine

setup:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'

test:
	$(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-engine:
	$(PY) bench/engine.py
