"""Environments: the raw simulators, the agent-turn parser, and a pool of worker processes."""

from qevolve.environments.base import (
    SPLITS,
    DataFile,
    Environment,
    StepResult,
    environment_names,
    make_environment,
    register_environment,
)

__all__ = ["SPLITS", "DataFile", "Environment", "StepResult", "environment_names", "make_environment",
           "register_environment"]
