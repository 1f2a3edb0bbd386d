# The two commands a newcomer needs: `make serve` and `make test`.
# Both build everything they need on a fresh machine and are fast to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.weir-installed
MODEL_READY := $(VENV)/.weir-model-ready
# One thread for the scheduler, the gateway and the tests (2 cores here); the executor sizes
# its own threads from the cores it may use (`make serve ARGS="--threads 1"` to pin it).
export OMP_NUM_THREADS ?= 1

# All of weir.services (the processes, the benchmark harness, the commands, the launcher
# and LLM), the kernels and weir.shared are type-checked strictly; mypy finds them by their
# import names through a link tree (pyproject maps the folders at install).
TYPED := -p weir.services.scheduler -p weir.services.engine -p weir.services.gateway \
	-p weir.services.executor -p weir.kernels -p weir.shared -m weir.services \
	-m weir.services.cli -m weir.services.llm -m weir.services.launcher \
	-m weir.services.cpu_cores -m weir.services.batch -m weir.services.config_file \
	-m weir.services.metrics_endpoint -m weir.services.sigterm -m weir.services.startup_heap \
	-m weir.services.supervised -p weir.services.bench

.PHONY: serve test lint setup model clean

setup: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, the CPU build (the wheel on disk where there is one, else PyTorch's CPU
# index: PyPI's Linux wheel is the CUDA one), so no later resolve pulls a CUDA build.
TORCH := torch==2.13.0+cpu
$(INSTALLED): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH) \
		|| $(PY) -m pip install -q $(TORCH) --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(MODEL_READY): $(INSTALLED)
	$(VENV)/bin/weir prepare-model
	touch $@

model: $(MODEL_READY)

serve: $(MODEL_READY)
	$(VENV)/bin/weir serve $(ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	mkdir -p $(VENV)/typecheck/weir
	for d in services shared kernels; do ln -sfn ../../../$$d $(VENV)/typecheck/weir/$$d; done
	cd $(VENV)/typecheck && MYPYPATH=. ../bin/mypy --config-file ../../pyproject.toml $(TYPED)

# One pytest-xdist worker per core this machine gives us (affinity capped by the cgroup quota,
# as the executors count them; at most 8: each holds its own servers and references), each
# pinned to a core by tests/conftest.py; a file's tests stay on one worker, which starts its
# module-scoped servers once for them.
TEST_WORKERS ?= $(shell $(PY) -c "from weir.services.cpu_cores import available_cpus as a; print(min(a().count, 8))")
test: $(MODEL_READY) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV)
