# The two commands of the README, and the manual. Each installs what it needs first (scripts/ensure-deps).
PYTHON ?= python3
export PYTHON

.PHONY: demo test bench deps docs

deps:
	@./scripts/ensure-deps

demo: deps
	$(PYTHON) -m gradhealth demo

test: deps
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=30

bench: deps
	$(PYTHON) -m gradhealth bench

# The manual (docs/, mkdocs.yml) built into site/; --strict: a broken link or a missing API reference fails.
docs: deps
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site
	@echo "gradhealth: the manual is in site/index.html (or: $(PYTHON) -m mkdocs serve)"
