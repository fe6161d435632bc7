# Two commands do all the set-up: `make run` and `make test`.
#
# PY is the interpreter the venv is made from. Unless it is given (`make run PY=python3.12`),
# the first of PY_CANDIDATES that can make a venv for us is taken: Python >= 3.11 with ensurepip
# and the headers our two C extensions compile against. The distribution's own /usr/bin/python3
# comes first because Debian, Ubuntu and Fedora build it with PGO and LTO and link libpython
# into the executable; a pyenv or plain ./configure build, which `python3` on PATH often is, has
# none of that (small produce requests cost the broker 8-24 % less CPU on Debian's build than on
# pyenv's: bench/HISTORY.md, session 48).
# An existing .venv keeps the interpreter it was made from: `make clean` to change it.
PY_CANDIDATES ?= /usr/bin/python3 python3
PY_USABLE = import ensurepip, os, sys, sysconfig; \
	sys.exit(sys.version_info < (3, 11) or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
ifeq ($(origin PY),undefined)
PY := $(shell for p in $(PY_CANDIDATES); do $$p -c '$(PY_USABLE)' >/dev/null 2>&1 && { echo $$p; exit; }; done; echo python3)
endif
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
# `make test` runs pytest on TEST_WORKERS pytest-xdist workers (the suite mostly waits on
# brokers and clients, so 4 workers keep 2 cores busy). Each test module is one unit of work
# and the heavy tests (cluster, chaos, Spark, bench) run in two lanes (tests/conftest.py:
# HEAVY_LANES, pytest_xdist_make_scheduler). A serial run: `make test ARGS=-n0` or
# `make test ARGS='-p no:xdist'`.
TEST_WORKERS ?= 4
XDIST = $(if $(findstring no:xdist,$(ARGS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
# The suite's processes write Python's bytecode caches even where the environment sets
# PYTHONDONTWRITEBYTECODE (these machines do): the suite starts hundreds of broker and client
# processes, and without the caches each one compiled its ~300 modules again (~0.7 s of CPU
# per broker start; 35 % of the wall time of a broker-heavy part of the suite, bench/HISTORY.md
# session 45). The caches go to __pycache__ directories git ignores.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE

.PHONY: run test test-fast bench bench-failover venv test-deps clean chaos-backpressure chaos

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py storage/_copycrc.c protocol/_produce.c
	$(BIN)/pip install -q -e .
	touch $@

# One pip run for the package and its test extras (one resolve, one editable build: a second
# `pip install -e .` first cost a minute). --no-compile: the suite imports a small part of what
# it installs (pyspark alone is thousands of modules); Python compiles that part on first use
# and keeps it (TEST_ENV).
$(VENV)/.test-installed: $(BIN)/python pyproject.toml setup.py storage/_copycrc.c protocol/_produce.c
	$(BIN)/pip install -q --no-compile -e '.[test]'
	touch $(VENV)/.installed $@

venv: $(VENV)/.installed

## Start one broker with the embedded defaults on 127.0.0.1:9092 (data under ./data).
run: $(VENV)/.installed
	$(BIN)/s3kafka serve $(ARGS)

## Install everything the tests need (Python clients, kcat, Java clients, ...) and run the whole suite.
test-deps: $(VENV)/.test-installed
	bash tests/setup_deps.sh

test: test-deps
	$(TEST_ENV) $(BIN)/python -m pytest -q -ra $(XDIST) $(ARGS)

## Quick loop for developers: skip the slow suites.
test-fast: test-deps
	$(TEST_ENV) $(BIN)/python -m pytest -q -ra -m "not slow" $(XDIST) $(ARGS)

## Long fault schedule for issue 21: small WAL, object store cut/black-holed/restored, kill -9.
CHAOS_ROUNDS ?= 20
chaos-backpressure: test-deps
	CHAOS_ROUNDS=$(CHAOS_ROUNDS) $(TEST_ENV) $(BIN)/python -m pytest -q -s -ra \
		tests/chaos/test_backpressure_faults.py -k long $(ARGS)

## Long fault schedule for issue 17 on a 3-broker cluster: random kill -9, SIGSTOP past the
## lease, object store / PostgreSQL cut, PostgreSQL restart, a tiny WAL filling up.
CHAOS_MINUTES ?= 30
chaos: test-deps
	CHAOS_MINUTES=$(CHAOS_MINUTES) $(TEST_ENV) $(BIN)/python -m pytest -q -s -ra \
		tests/chaos/test_cluster_faults.py -k long $(ARGS)

bench: $(VENV)/.test-installed
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.run_all

# kill -9 of one of 3 brokers under load, default lease; 3 runs, ~2.5 min (not in `bench`)
bench-failover: $(VENV)/.test-installed
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.failover $(ARGS)

clean:
	rm -rf $(VENV) data build *.egg-info tests/.cache
