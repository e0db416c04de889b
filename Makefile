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
# Test files run two at a time: one at a time, the suite keeps the 2 cores about 60%
# busy (its processes wait for timeouts, start-ups and launchers). The cores' tokens
# (harness/cores.py) decide which tests share them. loadfile keeps a file's tests, and the
# runs they share, on one worker. TEST_JOBS=0: one at a time.
TEST_JOBS ?= 2
# make bench QUICK=1: the few-minutes run; make report RUN=name: a benchmarks/results
# folder (default: the newest).
QUICK  ?=
RUN    ?=
BENCH_ARGS ?=
AZURITE := harness/azurite/node_modules/.bin/azurite-blob

# horovodrun and mpirun start `python` and `orted` by name: find the venv's first.
export PATH := $(BIN):$(PATH)
# Open MPI refuses root unless told; containers and CI run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

# The ends of the supported range (spotring/versions.py), each in an environment of its own
# beside .venv: the oldest Python with the oldest torch (constraints-oldest.txt), the newest
# Python with constraints.txt's torch. pip's cache (~/.cache/pip) keeps their downloads.
OLDEST_PYTHON ?= 3.10
NEWEST_PYTHON ?= 3.13
OLDEST := .venv-oldest
NEWEST := .venv-newest

.PHONY: help install horovod test test-fast test-ends disk-check lint train bench report clean

help:
	@echo "make train [NPROC=2] [ENGINE=ddp|horovod] [ARGS='dataset=cifar10 model=resnet20']"
	@echo "make test [TEST_JOBS=2]  the whole suite (installs .venv and builds Horovod first)"
	@echo "make test-fast     without the slow multi-process tests"
	@echo "make test-ends     the library's tests at the oldest and newest supported torch and Python"
	@echo "make disk-check    say whether make test has the disk it needs (about 22 GB the first time)"
	@echo "make install       .venv with pinned versions (constraints.txt)"
	@echo "make horovod       build Horovod 0.28.1 against the installed torch (cached)"
	@echo "make lint          ruff"
	@echo "make bench [QUICK=1] [BENCH_ARGS='--engines ddp plain']  benchmarks -> benchmarks/results/<run>/"
	@echo "make report [RUN=name]  report.md and plots of the newest (or named) benchmark run"
	@echo "make launch NODES=8 [CLUSTER=aws_spot|local] [DRY_RUN=1] [ARGS='trainer overrides']"
	@echo "                   spot nodes up, the trainer across them, everything down again"
	@echo "make down [RUN_ID=id]  delete what a launch left (default: the newest run)"
	@echo "make system-deps   Debian packages the local cluster, SLURM and their tests need (as root)"
	@echo "make gpu-bundle    gpu-bundle/: the wheels a GPU machine lacks (needs the package index)"
	@echo "make gpu-check [GPU_OUT=runs/gpu-check] [GPU_ARGS='--tiny']  the gpu tests and figures in one go"

install: $(VENV)/.installed $(AZURITE)

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade -c constraints.txt -e '.[mpi,horovod,bench,sweep,test]'
	touch $@

# Azurite, Microsoft's Azure Storage emulator, for the store tests (harness/stores.py): from
# npm, at the versions harness/azurite/package-lock.json pins, into harness/azurite/node_modules.
# Without npm, a note, and the Azure tests skip.
$(AZURITE): harness/azurite/package.json harness/azurite/package-lock.json
	@if command -v npm > /dev/null; then \
	    npm ci --prefix harness/azurite --no-audit --no-fund --loglevel=error && touch $@; \
	else \
	    echo "azurite: npm is missing: the Azure Blob store tests will skip"; \
	fi

horovod: install
	launch/node/build-horovod $(VENV)

test: disk-check install horovod system-deps
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) test-ends

# A full disk fails hundreds of tests at once, minutes in: say first where make test will
# not fit. Each environment not yet made takes about 7 GB (torch with its CUDA libraries),
# and the suite's runs about 2.5 GB (pytest keeps the last three under the temp directory).
disk-check:
	@need=3; for env in $(VENV) $(OLDEST) $(NEWEST); do \
	    [ -e $$env/.installed ] || need=$$((need + 7)); \
	done; \
	free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt "$$need" ]; then \
	    echo "disk-check: make test needs about $$need GB here and $$free GB are free:" \
	         "tests will fail with 'No space left on device'"; \
	fi

# The oldest end runs the in-process tests and those marked `ends` (one multi-rank proof of
# each engine, and of streamed shards); the newest Python runs the in-process tests. Each
# with its own launchers first on PATH.
test-ends: $(OLDEST)/.installed $(NEWEST)/.installed $(AZURITE) system-deps
	PATH=$(abspath $(OLDEST))/bin:$$PATH $(OLDEST)/bin/python -m pytest -n $(TEST_JOBS) \
	    --dist loadfile -m "not slow or ends" $(PYTEST_ARGS)
	PATH=$(abspath $(NEWEST))/bin:$$PATH $(NEWEST)/bin/python -m pytest -n $(TEST_JOBS) \
	    --dist loadfile -m "not slow" $(PYTEST_ARGS)

$(OLDEST)/.installed: pyproject.toml constraints-oldest.txt
	test -x $(OLDEST)/bin/python || "$$(tools/python $(OLDEST_PYTHON))" -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --upgrade -c constraints-oldest.txt -e '.[mpi,bench,sweep,test]'
	touch $@

$(NEWEST)/.installed: pyproject.toml constraints.txt
	test -x $(NEWEST)/bin/python || "$$(tools/python $(NEWEST_PYTHON))" -m venv $(NEWEST)
	$(NEWEST)/bin/pip install --upgrade -c constraints.txt -e '.[mpi,bench,sweep,test]'
	touch $@

# The inner loop: the tests in this process (library, config, bad input), no Horovod build.
test-fast: install system-deps
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

train: install
ifeq ($(ENGINE),horovod)
	$(MAKE) horovod
	horovodrun -np $(NPROC) -H localhost:$(NPROC) spotring train engine=horovod $(ARGS)
else
	torchrun --standalone --nproc-per-node $(NPROC) --no-python spotring train \
	    engine=$(ENGINE) $(ARGS)
endif

bench: install horovod
	$(BIN)/spotring bench $(if $(QUICK),--quick) $(BENCH_ARGS)

report: install
	$(BIN)/spotring report $(RUN)

# Spot clusters: spotring launch (docs/launching.md).
# LAUNCH_ARGS: launcher overrides, e.g. "cluster.instance_types=[g5.12xlarge] runs_dir=DIR",
# or for make down "--all-mine"; RUN_ID: a run of runs/launch/ (default: the newest).
NODES   ?= 1
CLUSTER ?= aws_spot
DRY_RUN ?=
LAUNCH_ARGS ?=
RUN_ID  ?=
.PHONY: launch down system-deps

# The local cluster's nodes run this machine's .venv, and an sshd each.
launch: install $(if $(filter local,$(CLUSTER)),horovod system-deps)
	$(BIN)/spotring launch nodes=$(NODES) cluster=$(CLUSTER) $(if $(DRY_RUN),--dry-run) \
	    $(LAUNCH_ARGS) -- $(ARGS)

down: install
	$(BIN)/spotring down cluster=$(CLUSTER) $(if $(RUN_ID),run_id=$(RUN_ID)) $(LAUNCH_ARGS)

# Debian packages: sshd for the local cluster, SLURM and munge for the SLURM tests
# (harness/slurm.py starts its own daemons; none is set up system-wide). Installed as root
# when a program of theirs is missing; elsewhere a note, and those tests skip.
SYSTEM_PACKAGES := openssh-server openssh-client slurmctld slurmd slurm-client munge
SYSTEM_PROGRAMS := /usr/sbin/sshd /usr/bin/ssh-keyscan /usr/sbin/slurmctld /usr/sbin/slurmd \
                   /usr/bin/srun /usr/sbin/munged
system-deps:
	@missing=$$(for p in $(SYSTEM_PROGRAMS); do [ -x $$p ] || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	            --no-install-recommends $(SYSTEM_PACKAGES); \
	    else \
	        echo "system-deps:" $$missing "missing, and this is not root on Debian: the" \
	             "local cluster, SLURM and their tests will not run"; \
	    fi; \
	fi

clean:
	rm -rf runs .pytest_cache

# The GPU kit (docs/gpu.md): spotring's wheel and those an offline GPU machine lacks, made
# here from the installed checkout, and every GPU check in one command there. A checkout's
# .venv has those packages; elsewhere (the GPU machine's own python3, with its torch) the
# bundle brings them, spotring included.
GPU_BUNDLE ?= gpu-bundle
GPU_OUT    ?= runs/gpu-check
GPU_ARGS   ?=
KIT_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
.PHONY: gpu-bundle gpu-check

gpu-bundle: install
	$(BIN)/python tools/gpu_bundle.py $(GPU_BUNDLE)

gpu-check:
	PYTHON=$(KIT_PYTHON) tools/gpu-check $(GPU_OUT) \
	    $(if $(wildcard $(BIN)/python),,--bundle $(GPU_BUNDLE)) $(GPU_ARGS)
