"""qevolve: Q-Evolve (ICML 2026) for LLM agents on ALFWorld, ScienceWorld and WebShop.

Data flow, one sub-package per stage:
environments -> rollouts -> buffer (trajectory store) -> critic -> process_rewards -> policy -> evaluation,
with ``evolve`` running the whole loop.
"""

__version__ = "0.1.0"
