# The two entry points of the README. Both run scripts/setup.sh first (idempotent).
.PHONY: setup quickstart test

setup:
	bash scripts/setup.sh

# The main job: one Q-Evolve iteration on a subset of ALFWorld with the embedded model (see configs/quickstart.yaml).
# Every step is idempotent or resumable: running it again continues where it stopped.
quickstart: setup
	.venv/bin/qevolve model install
	.venv/bin/qevolve data expert alfworld --limit 256
	.venv/bin/qevolve evolve --config configs/quickstart.yaml --resume
	.venv/bin/qevolve compare runs/quickstart

test: setup
	.venv/bin/python -m pytest -q
