# fullece — see README.md. Every target installs what it needs first.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
FULLECE = $(VENV)/bin/fullece
STAMP   = $(VENV)/.installed

# The default experiment (make extract / make metrics).
CORPUS_DIR ?= data/corpus
MODELS_DIR ?= data/models
RUNS_DIR   ?= runs
REPORT_DIR ?= report

.PHONY: install test test-fast lint bench extract metrics report clean

install: $(STAMP)

# A torch that is already importable (a GPU build, say) is used as it is: the
# venv then sees the system site-packages. Only when none is importable do we
# install the CPU wheel torch==2.13.0 (an unpinned torch pulls GBs of CUDA).
$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "using the torch already installed"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q "torch==2.13.0"; \
	fi
	$(VENV)/bin/pip install -q -e ".[extract,dev]"
	@touch $@

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline tests benchmarks
	$(VENV)/bin/ruff format --check pipeline tests benchmarks

bench: $(STAMP)
	$(VENV)/bin/pip install -q -e ".[bench]"
	$(PY) -m benchmarks.run_all --out benchmarks/results

extract: $(STAMP)
	$(FULLECE) default extract --corpus-dir $(CORPUS_DIR) --models-dir $(MODELS_DIR) --runs-dir $(RUNS_DIR)

metrics: $(STAMP)
	$(FULLECE) default metrics --runs-dir $(RUNS_DIR) --report-dir $(REPORT_DIR)

clean:
	rm -rf $(RUNS_DIR) $(REPORT_DIR) .pytest_cache .ruff_cache
