# The two entry points of the README. Both run scripts/setup.sh first (idempotent).
.PHONY: setup quickstart test

setup:
	bash scripts/setup.sh

# The main job: SFT, one Q-Evolve iteration and the RFT baseline on the WebShop quickstart protocol with
# the embedded model (configs/cpu/webshop-quick.yaml), then the comparison table with paired-bootstrap CIs.
# `--vllm` installs the vLLM backend only where it is the faster one (a GPU or a CPU with native bf16).
# Every step is idempotent or resumable: running it again continues where it stopped.
# QUICKSTART_ARGS adds key=value overrides, e.g. the settings `auto` picks on a CPU without native bf16:
#   make quickstart QUICKSTART_ARGS="model.precision=fp32 rollout.agent.backend=hf eval.agent.backend=hf"
quickstart:
	bash scripts/setup.sh --vllm
	.venv/bin/qevolve model install
	.venv/bin/qevolve data expert webshop
	.venv/bin/qevolve evolve --config configs/cpu/webshop-quick.yaml --resume $(QUICKSTART_ARGS)
	.venv/bin/qevolve compare runs/cpu-webshop-quick

# The tests install the vLLM backend where `make quickstart` would (its tests then run instead of skipping).
test:
	bash scripts/setup.sh --vllm
	.venv/bin/python -m pytest -q
