# The two entry points of the README. Both run scripts/setup.sh first (idempotent).
.PHONY: setup quickstart test

setup:
	bash scripts/setup.sh

# The main job: SFT, one Q-Evolve iteration and the RFT baseline on the WebShop quickstart protocol with
# the embedded model (configs/cpu/webshop-quick.yaml), then the comparison table with paired-bootstrap CIs.
# `--vllm` installs the vLLM backend where a wheel exists (a GPU, or a Linux x86-64 CPU with AVX2 or AVX-512).
# Every step is idempotent or resumable: running it again continues where it stopped.
# QUICKSTART_ARGS adds key=value overrides, e.g. transformers generation instead of vLLM:
#   make quickstart QUICKSTART_ARGS="rollout.agent.backend=hf eval.agent.backend=hf"
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
