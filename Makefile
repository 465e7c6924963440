# The two entry points of the README. Both run scripts/setup.sh first (idempotent).
.PHONY: setup quickstart test

setup:
	bash scripts/setup.sh

quickstart: setup
	.venv/bin/qevolve env play alfworld --split unseen --policy walkthrough

test: setup
	.venv/bin/python -m pytest -q
