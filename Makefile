# The two commands: `make test` and `make demo` (and `make bench`). Each sets up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardwise-installed

.PHONY: test demo bench setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first: the CPU wheel these machines carry. Installing the project
# before torch would let pip resolve `torch>=2.6` to a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# mypy --strict on src/ first (configured in pyproject.toml): a type error fails the run;
# --durations=40: the slowest tests in CI's log, where the suite's time goes
test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=40 tests

demo: $(STAMP)
	$(PY) -m shardwise.cli demo

# shardwise vs torch.distributed.tensor, side by side; JSON to bench/results/. BENCH_ARGS="--quick --only steps"
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
