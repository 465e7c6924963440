"""WebShop (1,000-product setting), implemented natively in text mode from its specification."""

from qevolve.environments.experts import register_expert_source
from qevolve.environments.play import register_play_policy
from qevolve.environments.webshop.catalog import Catalog, Goal, Product, load_catalog
from qevolve.environments.webshop.env import WebShopEnv
from qevolve.environments.webshop.oracle import FirstResultPolicy, OraclePolicy, webshop_expert_jobs, webshop_task_type

register_expert_source("webshop", task_type=webshop_task_type)(webshop_expert_jobs)
register_play_policy("webshop", "oracle", lambda seed: OraclePolicy())
register_play_policy("webshop", "first_result", lambda seed: FirstResultPolicy())

__all__ = ["Catalog", "Goal", "Product", "WebShopEnv", "OraclePolicy", "FirstResultPolicy", "load_catalog",
           "webshop_expert_jobs", "webshop_task_type"]
