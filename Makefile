# The two commands of the README: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# The CPU build of torch on machines without a GPU stack; override on ROCm/CUDA machines,
# e.g. `make test TORCH_SPEC=` to keep the torch you have.
TORCH_SPEC ?= torch==2.13.0
RANKS ?= 4
PYTEST_ARGS ?=
# where `make demo` writes its runs' JSON lines and pictures
DEMO_OUT ?= build/demo

# Open MPI refuses to run as root unless told; containers and CI run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PYTHONUNBUFFERED := 1

STAMP := build/.setup-stamp
NATIVE_SOURCES := $(shell find hip bindings -type f) CMakeLists.txt pyproject.toml
# scikit-build-core's editable finder knows the package's files as of the install: a package
# folder that gains or loses a file (its mtime changes) needs a re-install.
PACKAGE_DIRS := $(shell find rocmoe -type d -not -name __pycache__)

.PHONY: setup build demo test clean

setup: $(STAMP)

$(STAMP): $(NATIVE_SOURCES) $(PACKAGE_DIRS)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q scikit-build-core cffi
	$(PIP) install -q --no-build-isolation -e ".[test]"
	@mkdir -p build && touch $(STAMP)

build: setup

demo: setup
	mpiexec -n $(RANKS) --oversubscribe $(PYTHON) examples/demo.py --out $(DEMO_OUT)
	$(PYTHON) -m rocmoe.cli plot $(DEMO_OUT)/dlrm_train.jsonl $(DEMO_OUT)/moe_train.jsonl
	@echo "make demo: the pictures are in $(DEMO_OUT)/ (open $(DEMO_OUT)/moe_train_loss.png)"

# -rs: every skip is listed with its reason (under ROCMOE_REQUIRE_ALL=1 only GPU tests and the
# rocSHMEM compile may skip: tests/skip_policy.py)
test: setup
	$(PYTHON) -m pytest -q -rs $(PYTEST_ARGS) tests

clean:
	rm -rf build rocmoe/*.so
