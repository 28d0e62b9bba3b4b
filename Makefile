# tfimage developer entry points.  Everything runs as root on a Debian 12/13 machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: all venv lint wheel spank spank-other images cluster-up cluster-down cluster-status \
        demo man test test-unit test-cluster test-other-host mutate bench clean

all: venv spank

# New modules need a reinstall (strict editable mode links files): watch the folders.
$(VENV)/.done: pyproject.toml $(shell find agent prolog epilog src/tfimage -type d -not -name __pycache__)
	bash deploy/local/packages.sh
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]' \
	    --config-settings editable_mode=strict
	touch $@

venv: $(VENV)/.done

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	bash -n deploy/local/*.sh deploy/local/images/*.sh spank/*.sh tests/*.sh .ci/run
	bash deploy/local/role.sh venv
	cd deploy/ansible && PATH=$(CURDIR)/build/ansible/bin:$$PATH ANSIBLE_CONFIG=ansible.cfg ansible-lint -q
	cd deploy/ansible && ANSIBLE_CONFIG=ansible.cfg ../../build/ansible/bin/ansible-playbook \
	    -i inventory.example.ini site.yml --syntax-check >/dev/null

wheel:
	bash deploy/local/role.sh wheel

# tfimage(1) from the CLI's own parser; tfimage-spank(8) as written in docs/man/.
man: venv
	mkdir -p build/man
	$(PY) -m tfimage.agent.cli.manpage > build/man/tfimage.1
	cp docs/man/tfimage-spank.8 build/man/

spank:
	$(MAKE) -C spank all check-exports

# The other Slurm generation's spank.h, so both plugin code paths always compile.
spank-other:
	bash spank/build-other.sh

images:
	bash deploy/local/images/build.sh build/images

cluster-up:
	bash deploy/local/cluster.sh up

cluster-down:
	bash deploy/local/cluster.sh down

cluster-status:
	bash deploy/local/cluster.sh status

demo:
	bash deploy/local/demo.sh

test-unit: venv
	$(VENV)/bin/pytest -q --numprocesses=auto --maxprocesses=4 tests/unit

test-cluster: venv
	$(VENV)/bin/pytest -q tests/cluster

# The other Debian generation as a whole host: its root (cached), a fresh clone of
# HEAD, the demo and tests/run-all.sh there (under the cluster lock, like cluster-up).
test-other-host:
	bash deploy/local/other-host.sh run

# The whole suite: lint, both plugin builds, unit tests, then the cluster tier.
test: venv lint spank spank-other cluster-up
	$(VENV)/bin/pytest -q tests

# Mutants of the pure modules against their unit tests (alone on a checkout: it
# rewrites the module under test, and restores it).  Not part of .ci/run.
mutate: venv
	$(PY) tests/mutate.py

bench: venv
	$(VENV)/bin/python bench/run.py

clean:
	rm -rf build spank/build $(VENV)
