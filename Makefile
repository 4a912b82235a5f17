# The two commands a user needs: `make demo` and `make test`. Both install what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?=
PYTEST_ARGS ?=
SMOKE_ARGS ?=

.PHONY: install demo test protos clean compose-smoke

# Then numba's cache of the weightsync kernels (a minute from nothing, a second after).
install:
	bash deploy/install.sh
	$(PY) -m services.weightsync.precompile

demo: install
	$(VENV)/bin/meridian demo $(DEMO_ARGS)

# The linter first (ruff, configured in pyproject.toml); pytest exits 5 when it collected
# nothing, which is a failure for us too, loudly.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Builds the images, brings both compose regions up, runs one RL step through them and
# takes everything down (deploy/compose-smoke; tens of minutes the first time, so not in
# `make test`). Needs root or a reachable Docker daemon, docker-compose and debootstrap.
compose-smoke: install
	$(PY) deploy/compose-smoke $(SMOKE_ARGS)

# Regenerate the committed Python stubs and the API reference (docs/api.md) from protos/
# (tests fail when they drift).
protos: install
	$(PY) -m meridian.protogen
	$(PY) -m meridian.api_reference

clean:
	rm -rf $(VENV) .meridian build *.egg-info tests/node_client/node_modules
