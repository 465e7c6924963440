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

# ScienceWorld needs a Java runtime (>= 11): install it where we can, else say what to do.
if ! python -m qevolve.environments.sciworld.java >/dev/null 2>&1; then
  install_cmd=$(python -m qevolve.environments.sciworld.java --install-command 2>/dev/null || true)
  if [ -n "$install_cmd" ] && [ "$(id -u)" = 0 ]; then
    echo "setup: installing a Java runtime for ScienceWorld ($install_cmd)"
    apt-get update -qq && $install_cmd >/dev/null
  else
    python -m qevolve.environments.sciworld.java || true  # prints the one-line reason
    echo "setup: warning: ScienceWorld will not run until a Java runtime (>= 11) is installed" >&2
  fi
fi

# Data: from ../shared/data beside the checkout when present, else the upstream downloads.
qevolve data install all
