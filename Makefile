# The two commands a newcomer runs:   make demo   and   make test
PYTHON ?= python3
PIP    ?= $(PYTHON) -m pip
TORCH_PIN ?= torch==2.13.0
export CUDA_HOME ?= /usr/local/cuda

.PHONY: deps install build test test-all demo bench cuda-check cpp clean

# torch only when it is not importable (pinned: an unpinned torch pulls a multi-GB CUDA build)
deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	@$(PYTHON) -c "import ninja, pytest, hypothesis, numpy" 2>/dev/null || \
		$(PIP) install -q ninja pytest hypothesis numpy

# --no-build-isolation: build against the torch installed above, not a fresh one
install: deps
	$(PIP) install -q --no-build-isolation -e .

build: deps
	$(PYTHON) setup.py -q build_ext --inplace

test: install
	$(PYTHON) -m pytest -q tests

test-all: install
	ATTN_EXT_SLOW=1 $(PYTHON) -m pytest -q tests

demo: install
	@$(PYTHON) -c "import tqdm, matplotlib" 2>/dev/null || $(PIP) install -q tqdm matplotlib
	$(PYTHON) -m attn_ext.demo

bench: install
	$(PYTHON) benchmarks/bench_pos_enc.py
	$(PYTHON) benchmarks/bench_attention.py --device cpu

# nvcc compile-only of every csrc/**/*.cu for sm_80 and sm_90 (no GPU needed)
cuda-check: deps
	$(PYTHON) tools/cuda_check.py --arch 80,90 --fail-on-spill fa2_fwd_kernel

cpp: deps
	cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build build/cmake

clean:
	rm -rf build *.egg-info attn_ext/_C*.so demo_out
