# Two set-up commands: `make demo` and `make test`. Both create .venv on first use and
# reinstall only when pyproject.toml changes, so `make test` also runs with no network.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs install clean bench lock netbox guest-image

# Installs exactly what requirements-test.lock names, each file checked by its hash; the
# ranges in pyproject.toml are what `make lock` resolves the lock files from.
$(STAMP): pyproject.toml requirements-test.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements-test.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/deploybot demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml, docs/), built strict into a folder thrown away
# afterwards: a link to a page or an anchor that does not exist fails it. (Not --quiet:
# mkdocs 1.6 then drops the warnings before --strict counts them, and passes.)
docs: $(STAMP)
	site=$$(mktemp -d) && $(BIN)/mkdocs build --strict --site-dir "$$site"; \
		status=$$?; rm -rf "$$site"; exit $$status

test: lint docs
	$(BIN)/pytest

# Optional, needs the network: the real NetBox (its own Python >= 3.12 venv, in
# ~/.cache/deploybot/) that tests/test_netbox_*.py run against; without it they skip.
netbox:
	$(PYTHON) -m tests.support.netbox.install

# Optional, needs root and the network: the Debian 12 guest images (~/.cache/deploybot/
# guest-KEY/: ifupdown; guest-netplan-KEY/: netplan + systemd-networkd) that
# tests/test_realguest_*.py boot under QEMU; without them they skip. Then, where
# libguestfs-tools is installed, the "upstream" variants of the eni image that
# tests/test_template_build_*.py fetch and customise (upstream-KEY/, no network).
guest-image:
	$(PYTHON) -m tests.support.realguest.image
	if command -v guestfish >/dev/null; then $(PYTHON) -m tests.support.realguest.upstream; fi

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench_pipeline

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis

# Re-resolve the lock files from pyproject.toml's ranges (pip-tools in a throwaway venv).
lock:
	$(PYTHON) -m venv .lock-venv && .lock-venv/bin/python -m pip install --quiet pip-tools
	for extra in "" test; do \
		out=requirements$${extra:+-$$extra}.lock; \
		.lock-venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
			--no-emit-index-url --no-emit-find-links $${extra:+--extra $$extra} \
			-o $$out pyproject.toml; \
	done
	rm -rf .lock-venv
