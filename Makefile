# The README's commands: `make demo` and `make test` (+ `make bench`). Each sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: setup bytecode data slurm-up slurm-down horovod container-image demo test fresh-test timing-under-load unit lint bench golden wheelhouse clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The project's own modules compiled once (their __pycache__, git-ignored): with PYTHONDONTWRITEBYTECODE set, as on
# this machine kind, every process that imports cyclone_kit compiled its modules from source again (a rank of the
# trainer ~0.16 CPU-s, hundreds of processes in the suite; issue 27). A stale file is recompiled in memory by Python.
bytecode: setup
	@$(PY) -m compileall -q -j 0 cyclone_kit bench tests/helpers >/dev/null

# Real data for the tests and the demo: Debian's Fashion-MNIST (skipped where apt is not usable).
data:
	@if [ -d /usr/share/datasets/fashion-mnist ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/dev/null; } \
	  || echo "note: dataset-fashion-mnist not installed; real-data tests will be skipped"; \
	else echo "note: not root or no apt-get: real-data tests will be skipped"; fi

# The local Slurm cluster for the Slurm tier, with accounting (sacct). As root it must start (a
# failure stops `make test` with the script's own message); elsewhere the tier is skipped, saying why.
slurm-up:
	@if [ "$$(id -u)" = 0 ]; then bash scripts/local-slurm.sh start --with-accounting; \
	else bash scripts/local-slurm.sh start --with-accounting || echo "note: local Slurm cluster not started; the Slurm tier will be skipped"; fi

slurm-down:
	@bash scripts/local-slurm.sh stop

# Horovod (optional, issue 8): built once per machine from the PyPI sdist against the venv's torch,
# cached as a wheel (~10 min the first time, seconds after). If it cannot be built, its tests skip.
horovod: setup
	@VENV=$(VENV) bash scripts/build-horovod.sh || echo "note: Horovod not built; Horovod tests will be skipped"

# The Charliecloud test image (issue 30): Debian 12's minbase with its python3, built once per machine with mmdebstrap
# (~75 s the first time, cached under /var/tmp/cyclone-images; jobs bind the venv in). If it cannot be built, the
# container tests skip (they fail instead under CK_REQUIRE_SLURM=1 or CK_REQUIRE_CONTAINER=1).
container-image: setup
	@VENV=$(VENV) bash scripts/build-container-image.sh >/dev/null || echo "note: container image not built; container tests will be skipped"

demo: setup data bytecode
	bash scripts/demo.sh

lint: setup
	$(PY) -m ruff check .

unit: setup
	$(PY) -m pytest -q tests/unit

# As root (CI) every tier must run: CK_REQUIRE_{SLURM,ACCOUNTING,HOROVOD,EXTRAS,DATA,CONTAINER}=1 turn their skips into
# failures (tests/conftest.py). scripts/run-tests.sh runs the integration tier, the Slurm files that mostly wait and
# the unit tier side by side; whichever stream is free first takes the notebook's test, the other Slurm files (after
# the first ones) and the integration files that ask little CPU; it prints each tier's log whole, with what was
# skipped.
test: setup data slurm-up horovod container-image bytecode
	$(PY) -m ruff check .
	REQ=$$([ "$$(id -u)" = 0 ] && echo 1 || echo 0); \
	CK_REQUIRE_SLURM=$$REQ CK_REQUIRE_ACCOUNTING=$$REQ CK_REQUIRE_HOROVOD=$$REQ CK_REQUIRE_EXTRAS=$$REQ CK_REQUIRE_DATA=$$REQ CK_REQUIRE_CONTAINER=$$REQ bash scripts/run-tests.sh $(PY)

# `make test` as a fresh machine sees it, RUNS times: a clean clone each time, with the cluster's state, /etc/slurm
# and ~/.cache moved aside (put back afterwards), so a set-up step that works only thanks to leftovers fails here.
fresh-test:
	bash scripts/fresh-test.sh $(or $(RUNS),1)

# The timing-sensitive test files, RUNS times (default 3) in a row with a CPU burner on one core (issue 27).
timing-under-load: setup data slurm-up horovod container-image bytecode
	CK_REQUIRE_HOROVOD=1 bash scripts/timing-under-load.sh $(PY) $(or $(RUNS),3)

bench: setup bytecode
	$(PY) bench/run_all.py

# .whl/: the project's pure-Python dependencies as wheels, for a GPU machine that has torch and nothing
# else (bench/gpu_check.sh installs from it what its preflight finds missing).
wheelhouse: setup
	$(PY) bench/wheelhouse.py --out .whl

# Regenerate the golden sbatch scripts after an intended template change; review the diff.
golden: setup
	CK_REGEN_GOLDEN=1 $(PY) -m pytest -q tests/unit/test_render.py

clean:
	rm -rf runs .pytest_cache .ruff_cache
