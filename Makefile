# tfx: the two set-up commands are `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: quickstart test test-slow test-all test-parity install install-dev install-parity bench-peer gpu-wheels \
	tpu-libs tpu-compile gpu-libs gpu-compile bench-peer-gpu compile-configs clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/activate pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

$(VENV)/.installed-parity: $(VENV)/.installed-dev
	$(PIP) install -q -e '.[parity]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-parity: $(VENV)/.installed-parity

# Trains configs/quickstart.py (a small decoder on the Python standard library's own source)
# on the CPU, evaluates, samples, and prints where the run is. glibc's huge pages for large
# allocations: XLA:CPU maps each step's temporaries afresh, and 4 KiB pages are zero-filled one
# fault at a time (about 90 instead of 104-115 s here; ignored by an older glibc or another libc).
HUGE_PAGES := GLIBC_TUNABLES=$${GLIBC_TUNABLES:+$$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1
quickstart: install
	$(HUGE_PAGES) $(PY) -m tfx.quickstart --workdir runs/quickstart

# The suite on CPU (under 25 minutes on 2 cores); the sharding tests fake 8 devices themselves.
# The long end-to-end tests (marked slow: mesh invariance after training on 4 meshes, multi-process,
# fine-tuning over seeds, sweeps, fault injection) have their own target, and the parity suite its
# own (it needs torch); CI runs all three. Test files run in parallel, one pytest-xdist worker per
# usable core (nproc), at most 8 (TEST_WORKERS=0: one process); a file's tests stay on one worker,
# so its module fixtures (compiled models) are built once, and the workers share one XLA compilation
# cache (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install-dev tpu-libs gpu-libs
	$(PYTEST) -m "not slow" tests --ignore=tests/parity

test-slow: install-dev tpu-libs gpu-libs
	$(PYTEST) -m slow tests --ignore=tests/parity

test-all: install-dev tpu-libs gpu-libs
	$(PYTEST) tests --ignore=tests/parity

# Numerical parity with Hugging Face's PyTorch models (installs torch 2.13.0 and transformers).
test-parity: install-parity
	$(PYTEST) tests/parity

# tfx against Hugging Face's Flax models side by side (benchmarks/hf_flax/bench_peer.py), in its own
# venv: transformers 4.57.6 (the last with Flax models) cannot sit beside tfx's datasets/tokenizers.
# Extra arguments: make bench-peer ARGS="--models gpt2 --sizes small --reps 5".
PEER_VENV ?= benchmarks/.venv-peer
$(PEER_VENV)/.installed: benchmarks/hf_flax/requirements.txt pyproject.toml
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip
	$(PEER_VENV)/bin/pip install -q -r benchmarks/hf_flax/requirements.txt
	$(PEER_VENV)/bin/pip install -q --no-deps -e .
	touch $@

bench-peer: $(PEER_VENV)/.installed
	JAX_PLATFORMS=cpu $(PEER_VENV)/bin/python benchmarks/hf_flax/bench_peer.py $(ARGS)

# The wheels benchmarks/gpu/session.sh unpacks on a lent GPU machine, whose image has jax, flax,
# optax, orbax and sentencepiece but not ml-collections (pure Python; no network there), and, for
# its `peer` step only, transformers 4.57.6 with the imports it needs beyond that image (the
# versions benchmarks/.venv-peer resolved on 2026-11-28; built for the image's CPython 3.12 on
# x86-64). Carry benchmarks/gpu/wheels (and benchmarks/gpu/peer_wheels for `peer`) with the call.
PEER_WHEELS = transformers==4.57.6 huggingface-hub==0.36.2 tokenizers==0.22.2 safetensors==0.8.0 \
	regex==2026.11.19 filelock==4.3.1 fsspec==2026.6.0 requests==2.34.2 urllib3==2.8.0 idna==3.20 \
	certifi==2026.10.19.post1 charset-normalizer==3.5.3 tqdm==4.70.1 packaging==26.4
gpu-wheels:
	mkdir -p benchmarks/gpu/wheels benchmarks/gpu/peer_wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d benchmarks/gpu/wheels "ml-collections==1.1.0"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform any -d benchmarks/gpu/peer_wheels $(PEER_WHEELS)

# libtpu beside the venv, not in it (there jax would look for a TPU at every start), for the train
# steps compiled for a TPU slice on this machine, which has none (tfx/bench_lower.py; a test uses
# it). The version is the one the installed jax's [tpu] extra requires (libtpu==0.0.42.* for jax
# 0.10.2). Extra arguments: make tpu-compile ARGS="--topology v5e:16x16 --batch 8 --only gpt2_small".
TPU_LIBS ?= .tpu-libs
LIBTPU_OF_JAX := import importlib.metadata as m; \
  print([r.split(";")[0] for r in m.requires("jax") if r.startswith("libtpu")][0])
$(TPU_LIBS)/.installed: $(VENV)/.installed
	$(PIP) install -q --no-deps --upgrade --target $(TPU_LIBS) "$$($(PY) -c '$(LIBTPU_OF_JAX)')"
	touch $@

tpu-libs: $(TPU_LIBS)/.installed

# The TPU_* variables only keep libtpu from probing for a TPU VM's metadata (and warning that it
# found none), ALLOW_MULTIPLE_LIBTPU_LOAD lets two such compiles run at once (libtpu's lock file
# guards a TPU, and none is used).
tpu-compile: install tpu-libs
	JAX_PLATFORMS=cpu PYTHONPATH=$(TPU_LIBS) TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost \
	  TPU_ACCELERATOR_TYPE=v5litepod-4 ALLOW_MULTIPLE_LIBTPU_LOAD=1 \
	  $(PY) -m tfx.bench --suite accel --lower tpu --topology v5e:2x2 $(ARGS)

# Every config's own step (configs/*_base.py: its dropout, attention and remat; bf16, 8 rows a device)
# and the accelerator suite's four (accel.NAME) compiled here for a v5e 2x2, or for GPUs with
# ARGS="--topology h100" (libtpu and the CUDA plugin installed first), each in a process of its own; exits 1 if any fails (benchmarks/compile_configs.py). ARGS="--check FILE" compares
# the bytes each step moves and its memory with a record (tests/golden/compiled_*.json), "--record FILE"
# takes one.
compile-configs: install tpu-libs gpu-libs
	$(PY) benchmarks/compile_configs.py $(ARGS)

# JAX's CUDA plugin with CUDA's compiler pieces and cuDNN (1.7 GB to download, 2.8 GB on disk), beside
# the venv, for the train steps compiled by XLA:GPU for an H100 or H200 on this machine, which has no
# GPU (tfx/bench_lower.py; make test compiles a tiny GPT-2 with it, make test-slow checks every step's
# bytes against tests/golden/compiled_h100.json). The plugin's version is the installed jaxlib's;
# CUDA's pieces and cuDNN are pinned (they make the program the record holds). Extra arguments as for
# tpu-compile.
GPU_LIBS ?= .gpu-libs
JAXLIB_VERSION := import importlib.metadata as m; print(m.version("jaxlib"))
$(GPU_LIBS)/.installed: $(VENV)/.installed
	J="$$($(PY) -c '$(JAXLIB_VERSION)')" && \
	$(PIP) install -q --no-deps --target $(GPU_LIBS) "jax-cuda12-plugin==$$J" "jax-cuda12-pjrt==$$J" \
	  "nvidia-cuda-runtime-cu12==12.9.79" "nvidia-cuda-nvcc-cu12==12.9.86" "nvidia-nvjitlink-cu12==12.9.86" \
	  "nvidia-cuda-nvrtc-cu12==12.9.86" "nvidia-cublas-cu12==12.9.3.13" "nvidia-cuda-cupti-cu12==12.9.79" \
	  "nvidia-cudnn-cu12==9.28.0.42"
	touch $@

gpu-libs: $(GPU_LIBS)/.installed

# bench-peer's comparison compiled by XLA:GPU for an H100 here (no GPU): temporary memory and compile
# time, tfx / HF, in bf16 (benchmarks/hf_flax/compile_peer.py).
bench-peer-gpu: $(PEER_VENV)/.installed gpu-libs
	JAX_PLATFORMS=cpu PYTHONPATH=$(GPU_LIBS) $(PEER_VENV)/bin/python benchmarks/hf_flax/compile_peer.py $(ARGS)

gpu-compile: install gpu-libs
	JAX_PLATFORMS=cpu PYTHONPATH=$(GPU_LIBS) $(PY) -m tfx.bench --suite accel --lower gpu --topology h100 $(ARGS)

clean:
	rm -rf runs .pytest_cache
