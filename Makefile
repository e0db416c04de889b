# spotring: `make train` trains, `make test` tests; both set up .venv first.
# `make help` lists the targets.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(abspath $(VENV))/bin
# Workers on this machine: one per GPU, else 2 CPU workers.
NPROC  ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)
ENGINE ?= ddp
ARGS   ?=
PYTEST_ARGS ?=

# horovodrun and mpirun start `python` and `orted` by name: find the venv's first.
export PATH := $(BIN):$(PATH)
# Open MPI refuses root unless told; containers and CI run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: help install horovod test test-fast lint train clean

help:
	@echo "make train [NPROC=2] [ENGINE=ddp|horovod] [ARGS='dataset=cifar10 model=resnet20']"
	@echo "make test          the whole suite (installs .venv and builds Horovod first)"
	@echo "make test-fast     without the slow multi-process tests"
	@echo "make install       .venv with pinned versions (constraints.txt)"
	@echo "make horovod       build Horovod 0.28.1 against the installed torch (cached)"
	@echo "make lint          ruff"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade -c constraints.txt -e '.[mpi,horovod,bench,test]'
	touch $@

horovod: install
	tools/build-horovod $(VENV)

test: install horovod
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

train: install
ifeq ($(ENGINE),horovod)
	$(MAKE) horovod
	horovodrun --gloo -np $(NPROC) -H localhost:$(NPROC) python -m trainer engine=horovod $(ARGS)
else
	torchrun --standalone --nproc-per-node $(NPROC) -m trainer engine=$(ENGINE) $(ARGS)
endif

clean:
	rm -rf runs .pytest_cache
