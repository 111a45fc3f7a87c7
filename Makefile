# The two commands of the README: `make demo` and `make test`. Both do all set-up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
ZOO := $(VENV)/.installed-zoo

.PHONY: demo test data lint typecheck imports bench mutants clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# the suite's IST zoo (transformers, torchvision, timm: docs/IST.md, "The zoo"), not the demo's
$(ZOO): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,zoo]'
	touch $(ZOO)

data: $(STAMP)
	$(PY) -m thinwire.kernels
	$(PY) -m thinwire.data.setup
	$(PY) -m thinwire.data.shakespeare_words

demo: $(STAMP) data
	$(VENV)/bin/thinwire compare --config configs/demo.toml --overwrite \
		--methods dp,localsgd,ist

test: $(ZOO) data
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

mutants: $(ZOO) data
	$(PY) tools/mutants.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

imports: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_imports.py

clean:
	rm -rf $(VENV) runs .pytest_cache
