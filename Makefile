# `make demo` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.xmodal-installed
DEMO_DIR ?= demo_run
DOCKER_ENV ?= docker/.env

.PHONY: install demo test lint bench clean docker-dirs

install: $(STAMP)

# torch and torchvision come from PyPI together (the CUDA build also runs on CPU).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch torchvision
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/xmodal demo --workdir $(DEMO_DIR)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	for b in tests/benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

# The host folders the compose services write, created as you (docker/dirs.sh says why).
docker-dirs:
	docker/dirs.sh $(DOCKER_ENV)

clean:
	rm -rf $(VENV) $(DEMO_DIR) site

# The wheels the lent GPU machine lacks (lmdb), for CPython 3.10-3.13 on Linux x86_64, into .gpu_wheels/
# (git-ignored): carry it to the device; tests/benchmarks/gpu_all.py installs from it.
.PHONY: gpu-wheels
gpu-wheels:
	for v in 3.10 3.11 3.12 3.13; do \
		$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version $$v \
			--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 lmdb -d .gpu_wheels || exit 1; \
	done
