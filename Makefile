# Two entry points for a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DOMINO_HOST ?= 127.0.0.1
DOMINO_PORT ?= 8000

.PHONY: install serve test test-fast test-container lint clean

# docker/install.sh is also the Docker image's install step: the image installs what CI tests.
$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml docker/install.sh
	bash docker/install.sh all $(VENV)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	DOMINO_HOST=$(DOMINO_HOST) DOMINO_PORT=$(DOMINO_PORT) $(VENV)/bin/domino-serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	bash scripts/ensure_prometheus.sh
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The real image, built and run (podman or docker, the network, ~15-30 min): not part of `make test`.
test-container: $(STAMP)
	bash docker/smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache
