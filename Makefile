# Stepward. `make run` starts the whole product on embedded defaults; `make test` runs the tests.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
# Django 6 needs Python >= 3.12: take python3.13, else python3.12, else pyenv's copies.
FIND_PYTHON = for p in python3.13 python3.12 $$HOME/.pyenv/versions/3.13*/bin/python3.13 \
	$$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	if "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then \
	echo "$$p"; break; fi; done

.PHONY: help
help:
	@echo "make run    set up and run Stepward on SQLite with an embedded broker (http://127.0.0.1:8000;"
	@echo "            PORT=8001 TICKETDESK_PORT=8766 make run picks other ports)"
	@echo "make test   set up and run the linters and the test suites"
	@echo "make lint   ruff and mypy only"

$(VENV)/.installed: pyproject.toml
	@py="$$($(FIND_PYTHON))"; \
	if [ -z "$$py" ]; then echo "Stepward needs Python 3.12 or newer (python3.13 or python3.12 on PATH)." >&2; exit 1; fi; \
	if [ ! -x $(PY) ]; then echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV); fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

.PHONY: install
install: $(VENV)/.installed

# Agent frameworks nobody here wrote (LangChain's MCP adapters, pydantic-ai, the OpenAI Agents
# SDK) need the 1.x mcp SDK, the project the 2.x one: they get a venv of their own, which
# tests/recovery/test_mcp_frameworks.py drives as subprocesses.
CLIENTS_VENV := .venv-clients
$(CLIENTS_VENV)/.installed: tests/clients/requirements.txt
	@py="$$($(FIND_PYTHON))"; \
	if [ -z "$$py" ]; then echo "Stepward needs Python 3.12 or newer (python3.13 or python3.12 on PATH)." >&2; exit 1; fi; \
	if [ ! -x $(CLIENTS_VENV)/bin/python ]; then echo "creating $(CLIENTS_VENV) with $$py"; "$$py" -m venv $(CLIENTS_VENV); fi
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install --quiet -r tests/clients/requirements.txt
	touch $@

# MCP servers nobody here wrote, from the npm registry, put behind the gateway by the tests
# (tests/executor/test_gateway.py): installed from the lock file with the machine's npm.
UPSTREAMS := tests/upstreams
# Without npm they are not installed, and the tests that need them are said NOT RUN.
$(UPSTREAMS)/node_modules/.installed: $(UPSTREAMS)/package.json $(UPSTREAMS)/package-lock.json
	@if command -v npm >/dev/null; then \
	  npm ci --prefix $(UPSTREAMS) --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "no npm here: the npm MCP servers of the gateway tests are not installed"; fi

# With DEBUG off Django refuses to start without a secret key. Unless SECRET_KEY or
# SECRET_KEY_FILE is set, `make run` uses var/secret.key (made once, random, mode 0600): every
# process `manage.py up` starts reads it through SECRET_KEY_FILE, so sessions and the
# ledger's chains survive a restart.
KEY_FILE = $${STEPWARD_VAR_DIR:-$(CURDIR)/var}/secret.key

.PHONY: secret-key
secret-key:
	@if [ -z "$${SECRET_KEY:-}$${SECRET_KEY_FILE:-}" ] && [ ! -s "$(KEY_FILE)" ]; then \
	  mkdir -p "$$(dirname "$(KEY_FILE)")" && \
	  (umask 077 && head -c 48 /dev/urandom | base64 | tr -d '\n' > "$(KEY_FILE).new") && \
	  mv "$(KEY_FILE).new" "$(KEY_FILE)" && \
	  echo "made a secret key for this machine: $(KEY_FILE)"; \
	fi

# `up` checks its ports, then migrates the database, then starts everything.
.PHONY: run
run: install secret-key
	@if [ -z "$${SECRET_KEY:-}" ]; then export SECRET_KEY_FILE="$${SECRET_KEY_FILE:-$(KEY_FILE)}"; fi; \
	set -x; $(PY) manage.py up

# mypy's Django plugin and makemigrations load the settings: a throwaway key for them.
.PHONY: lint
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	SECRET_KEY="$${SECRET_KEY:-lint-only-not-a-secret}" $(VENV)/bin/mypy .
	SECRET_KEY="$${SECRET_KEY:-lint-only-not-a-secret}" $(PY) manage.py makemigrations --check --dry-run

.PHONY: test
test: install lint $(CLIENTS_VENV)/.installed $(UPSTREAMS)/node_modules/.installed
	bash .ci/test-suites
