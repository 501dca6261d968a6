# make demo : create .venv, install, run the embedded pair (DFlash vs plain decoding, same run)
# make test : create .venv, install with dev dependencies, run the test suite
# make plugin-check : compile the TensorRT plugin against ../shared/vendor/tensorrt headers, host-test it (no GPU, no venv)
PYTHON ?= python3
# test processes: each runs whole test files (their module fixtures build engines once), torch on one thread each
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1

.PHONY: demo test venv dev clean plugin-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	# torch first, exact pin: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/dflash-trt demo

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

plugin-check:
	$(PYTHON) -m dflash_trt.plugins.tensorrt.plugin_check

clean:
	rm -rf $(VENV) build *.egg-info
