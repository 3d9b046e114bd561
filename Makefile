# Quick start: `make demo` and `make test`. Both set everything up from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
CMAKE_CORE := cmake -G Ninja -DOPMESH_BUILD_EXTENSION=OFF -DOPMESH_BUILD_TESTS=ON
# ccache sees paths inside the tree as relative ones, so the builds of the same sources into
# build/<folder> (the extension, the core's tests, the MindSpore and torch-next environments)
# share every object compiled with the same flags (and the same compiler name: every build gets
# make's CXX, g++ unless set).
export CCACHE_BASEDIR := $(CURDIR)
export CXX

.PHONY: demo test test-mindspore test-torch-next build system-deps test-cpp test-asan test-py test-packaging lint check-core-free-of-torch bench kernel-rates

demo: build
	$(PY) -m opmesh demo
	$(PY) -m opmesh mesh-demo
	$(PY) examples/train_indexer_warmup.py --steps 40
	$(PY) examples/train_dsa.py --steps 60 --plot dsa_training.png
	$(PY) examples/train_dsa.py --model v4 --steps 120 --plot dsa_v4_training.png
	$(PY) examples/decode_v4.py

test: build test-cpp test-asan check-core-free-of-torch lint test-py test-packaging

system-deps:
	@bash scripts/install-system-deps.sh

$(DEPS_STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt
	touch $@

# Builds the extension into the virtual environment (editable: Python files are used in place).
build: system-deps $(DEPS_STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

# The kernel-rate program beside the core's tests (benchmarks/bench_kernel_rates.py runs it).
kernel-rates: system-deps
	$(CMAKE_CORE) -S . -B build/core-tests >/dev/null
	cmake --build build/core-tests --target opmesh_kernel_rates

test-cpp: system-deps
	$(CMAKE_CORE) -S . -B build/core-tests >/dev/null
	cmake --build build/core-tests
	cd build/core-tests && ctest --output-on-failure

# -O1 -g1: what the sanitizers need (frames, lines), and 35% fewer compile seconds than -O2 -g.
test-asan: system-deps
	$(CMAKE_CORE) -DOPMESH_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -S . -B build/core-asan >/dev/null
	cmake --build build/core-asan
	cd build/core-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure

# The core must stay framework-neutral (docs/architecture.md).
check-core-free-of-torch:
	@if grep -rEn '#\s*include\s*[<"](torch|ATen|c10|pybind11|Python)' csrc/core; then \
	  echo "csrc/core must not include torch, ATen, c10 or Python headers"; exit 1; \
	else echo "csrc/core is free of framework includes"; fi
	@# The MindSpore binding compiles the core's headers as C++17. The per-ISA headers are
	@# compiled here without their instruction-set flags, so the ABI note GCC gives for AVX-512
	@# vector returns (-Wpsabi) does not apply: only translation units built with them include them.
	@for h in $$(cd csrc/core && find . -name '*.h'); do echo "#include \"$$h\""; done \
	  | g++ -std=c++17 -fsyntax-only -Wno-psabi -DOPMESH_HAVE_AMX=1 -Icsrc/core -x c++ - \
	  && echo "csrc/core's headers compile as C++17"

lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check opmesh tests benchmarks
	$(VENV)/bin/ruff format --check opmesh tests benchmarks
	$(VENV)/bin/clang-format --dry-run --Werror $$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'tests/cpp/*.cpp')

# Compiled graphs are cached in the tree's build folder, so a clean clone compiles everything
# afresh, as CI does (a warm shared cache hides first-compile behaviour such as Dynamo restarts).
test-py: build
	TORCHINDUCTOR_CACHE_DIR=$${TORCHINDUCTOR_CACHE_DIR:-$(CURDIR)/build/inductor-cache} $(PY) -m pytest -q

# The MindSpore suite in its own environment (.venv-mindspore: MindSpore 2.10 needs numpy 1.x).
# opmesh is installed there with OPMESH_MINDSPORE=ON (its own build directory); the binding is
# compiled by MindSpore's CustomOpBuilder on first use, into build/mindspore-cache.
MS_VENV := .venv-mindspore
MS_STAMP := $(MS_VENV)/.deps-installed
$(MS_STAMP): requirements-mindspore.txt
	$(PYTHON) -m venv $(MS_VENV)
	$(MS_VENV)/bin/pip install -q --disable-pip-version-check -r requirements-mindspore.txt
	touch $@

test-mindspore: system-deps $(MS_STAMP)
	$(MS_VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
	  -C build-dir=build/mindspore-env -C cmake.define.OPMESH_MINDSPORE=ON -e .
	OPMESH_MINDSPORE_CACHE=$(CURDIR)/build/mindspore-cache $(MS_VENV)/bin/python -m pytest -q tests/mindspore

# The Python suite against the newest torch these machines reach (2.14: pip takes a CUDA build,
# which runs on the CPU) in its own environment (.venv-torch-next), the extension built there
# from the same sources into its own build directory. Every test function runs, with the first
# and last cases of its grid and the mesh suites on two shapes (--grid=sample, conftest.py): the
# kernels are the same sources, and test-py runs every case against the pinned torch.
NEXT_VENV := .venv-torch-next
NEXT_TORCH := torch==2.14.1
NEXT_STAMP := $(NEXT_VENV)/.deps-installed
$(NEXT_STAMP): requirements.txt
	$(PYTHON) -m venv $(NEXT_VENV)
	sed '/^torch==/d' requirements.txt > $(NEXT_VENV)/requirements.txt
	$(NEXT_VENV)/bin/pip install -q --disable-pip-version-check $(NEXT_TORCH) \
	  -r $(NEXT_VENV)/requirements.txt
	touch $@

test-torch-next: system-deps $(NEXT_STAMP)
	$(NEXT_VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
	  -C build-dir=build/torch-next -e .
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-cache-next $(NEXT_VENV)/bin/python -m pytest -q --grid=sample tests/python

# pip install . and pip wheel . in a fresh virtual environment that has only torch.
test-packaging: system-deps
	bash tests/packaging/check_install.sh

bench: build
	$(PY) benchmarks/bench_indexer.py
	$(PY) benchmarks/bench_flash_attn.py
	$(PY) benchmarks/bench_dispatch.py
	$(PY) benchmarks/bench_bf16_kernels.py
	$(PY) benchmarks/bench_flash_attn_backward.py
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_kernel_rates.py
	$(PY) benchmarks/bench_indexer_kl_loss.py
	$(PY) benchmarks/bench_dsa.py
	$(PY) benchmarks/bench_context_parallel.py
	$(PY) benchmarks/bench_context_parallel.py --world 4 --seq 16384 --heads 32 --kv-heads 8 --repeats 1
	$(PY) benchmarks/bench_dsa_mesh.py
	$(PY) benchmarks/bench_transformers.py
	$(PY) benchmarks/model_context_parallel.py
