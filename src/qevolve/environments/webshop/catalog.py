"""The 1,000-product catalogue and the 6,910 synthetic goals built from it.

Products come from ``items_shuffle_1000.json`` (titles, descriptions, bullet points, prices,
options) and ``items_ins_v2_1000.json`` (attributes, and for 415 products a synthetic instruction
with the attributes it asks for). Goals follow WebShop's synthetic-goal rules: one goal per
combination of option values of every product with an instruction, an optional price ceiling,
then a shuffle with seed 233 (so goal *i* is the same product and options as upstream's goal *i*).

Every random choice is seeded (upstream seeded only the shuffle): the price of a product listed
with a price range is a uniform draw from ``Random("<seed>/price/<asin>")`` and the price ceiling
of its goals comes from ``Random("<seed>/ceiling/<asin>")``, so goals and prices are the same in
every process and on every machine (string seeds are hashed with SHA-512 by ``random``, never with
the per-process ``hash``).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from qevolve.environments.base import DataFile
from qevolve.environments.installed_data import require_installed

PRODUCTS_FILE = "items_shuffle_1000.json"
ATTRIBUTES_FILE = "items_ins_v2_1000.json"

_WEBSHOP = "https://raw.githubusercontent.com/princeton-nlp/WebShop/64fa2a5c15c7daa698b9ac93f5bb5437b634c9bd/baseline_models/data/"
_AGENTGYM = "https://raw.githubusercontent.com/WooooDyy/AgentGym/3ef9235d23e68e7c2920c5422ad957dc8ced5c6c/agentenv-webshop/webshop/data/"
#: what ``qevolve data install webshop`` copies (their provenance and checksums are listed in the data README,
#: shared/data/README.md; the files without a url have no single upstream download with that checksum)
DATA_FILES = (
    DataFile("webshop/items_shuffle_1000.json",
             "e84c57d80d836bf0db1f990668a2b3b220ea1431b1da51d361e8045c5d7451ae"),
    DataFile("webshop/items_ins_v2_1000.json",
             "f88a36314a397b53b3d9c3fa5878e5f7b26d35019a51ec83fbedeca61a948f6f",
             url=_AGENTGYM + "items_ins_v2_1000.json"),
    DataFile("webshop/items_human_ins.1k_subset.json",
             "8bc0ae02b37351395091c55b29352ba21a26a231d093c151cf1a83847ca66359"),
    DataFile("webshop/human_goals.json",
             "b68746ed66cd31fdc5f70eb3f5831a46b38163563b57a66ddcab8fd60ee0cbdc",
             url=_WEBSHOP + "human_goals.json"),
    DataFile("webshop/goal_query_map.json",
             "1524f438ffbc51c7e308e635d7d9e14fa696b08f5d4300922d454ef0105cea86",
             url=_WEBSHOP + "goal_query_map.json"),
)
DEFAULT_SEED = 233  # WebShop's goal-shuffle seed, also the root of the other seeded draws
DEFAULT_PRICE = 100.0  # price of a product listed without one
NO_PRICE_LIMIT = 1_000_000.0  # price ceiling of goals without one (as upstream)
PRICE_STEPS = [10.0 * i for i in range(1, 100)]  # 10, 20, ..., 990: candidate price ceilings
MAX_ASIN_LENGTH = 10


@dataclass(frozen=True)
class Product:
    asin: str
    title: str
    description: str
    bullet_points: tuple[str, ...]
    pricing: tuple[float, ...]  # one price, or the two ends of a range
    price_tag: str  # as shown: "$19.99" or "$19.99 to $27.99"
    price: float  # the price the reward checks: the single price or a seeded draw in the range
    options: dict[str, tuple[str, ...]]  # option name -> values, lower-cased, in catalogue order
    attributes: tuple[str, ...]
    category: str  # the coarse category (beauty, electronics, fashion, garden, grocery)
    query: str  # the search query the product was collected with
    product_category: str  # "A › B › C" breadcrumb
    instruction: str | None = None  # the synthetic instruction, when the product has one
    instruction_attributes: tuple[str, ...] = ()

    def search_text(self) -> str:
        """The indexed text: title, description, first bullet point and options, lower-cased."""
        option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in self.options.items())
        first_bullet = self.bullet_points[0] if self.bullet_points else ""
        return " ".join([self.title, self.description, first_bullet, option_text]).lower()


@dataclass(frozen=True)
class Goal:
    index: int  # position after the seed-233 shuffle; task id "goal-<index:05d>"
    asin: str  # the target product
    instruction: str  # the full text shown to the agent
    attributes: tuple[str, ...]  # what the instruction asks for (instruction_attributes)
    options: tuple[tuple[str, str], ...]  # (option name, value), names sorted
    price_upper: float  # NO_PRICE_LIMIT when the text states no ceiling

    @property
    def task_id(self) -> str:
        return goal_task_id(self.index)


def goal_task_id(index: int) -> str:
    return f"goal-{index:05d}"


_TASK_ID_RE = re.compile(r"^goal-(\d+)$")


def goal_index(task_id: str) -> int:
    match = _TASK_ID_RE.match(task_id.strip())
    if not match:
        raise ValueError(f"WebShop task id {task_id!r}: expected 'goal-<index>', e.g. 'goal-00042'")
    return int(match.group(1))


def parse_pricing(pricing: str | None) -> tuple[float, ...]:
    """"$12.5" -> (12.5,), "$2.99 - $6.99" -> (2.99, 6.99), "" -> (100.0,); at most two values."""
    if not pricing:
        return (DEFAULT_PRICE,)
    values = []
    for piece in pricing.split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece)
        if digits:
            values.append(float(digits))
    return tuple(values[:2]) or (DEFAULT_PRICE,)


def price_tag(pricing: tuple[float, ...]) -> str:
    return f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}"


def parse_options(raw) -> dict[str, tuple[str, ...]]:
    """{"Size": [{"value": "X-Large"}, ...], "Color": null} -> {"size": ("x-large", ...)}."""
    if not isinstance(raw, dict):
        return {}
    options: dict[str, tuple[str, ...]] = {}
    for name, contents in raw.items():
        if contents is None:
            continue
        values = tuple(str(item["value"]).strip().replace("/", " | ").lower() for item in contents)
        options[name.lower()] = values
    return options


def _seeded_rng(seed: int, purpose: str, asin: str) -> random.Random:
    return random.Random(f"{seed}/{purpose}/{asin}")


@dataclass
class Catalog:
    products: dict[str, Product]  # asin -> product, in catalogue order
    goals: list[Goal]
    seed: int
    source: Path
    _search_index: object | None = field(default=None, repr=False)

    @property
    def search_index(self):
        """The BM25 index over the products (built on first use, kept with the catalogue)."""
        if self._search_index is None:
            from qevolve.environments.webshop.search import BM25Index

            self._search_index = BM25Index({asin: p.search_text() for asin, p in self.products.items()})
        return self._search_index


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"WebShop data file missing: {path} (run `qevolve data install webshop`)") from None
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def load_products(data_root: Path, seed: int = DEFAULT_SEED) -> dict[str, Product]:
    raw_products = _read_json(data_root / PRODUCTS_FILE)
    raw_attributes = _read_json(data_root / ATTRIBUTES_FILE)
    if not isinstance(raw_products, list) or not isinstance(raw_attributes, dict):
        raise ValueError(f"{data_root}: expected a list in {PRODUCTS_FILE} and an object in {ATTRIBUTES_FILE}")
    products: dict[str, Product] = {}
    for raw in raw_products:
        asin = str(raw.get("asin", ""))
        if asin == "nan" or not asin or len(asin) > MAX_ASIN_LENGTH or asin in products:
            continue
        bullets = raw.get("small_description") or []
        bullets = tuple(bullets) if isinstance(bullets, list) else (bullets,)
        pricing = parse_pricing(raw.get("pricing"))
        if len(pricing) == 1:
            price = pricing[0]
        else:
            price = _seeded_rng(seed, "price", asin).uniform(pricing[0], pricing[1])
        extra = raw_attributes.get(asin) or {}
        instruction = extra.get("instruction") or None
        products[asin] = Product(
            asin=asin,
            title=raw.get("name") or "",
            description=raw.get("full_description") or "",
            bullet_points=bullets,
            pricing=pricing,
            price_tag=price_tag(pricing),
            price=price,
            options=parse_options(raw.get("customization_options")),
            attributes=tuple(extra["attributes"]) if "attributes" in extra else ("DUMMY_ATTR",),
            category=raw.get("category") or "",
            query=raw.get("query") or "",
            product_category=raw.get("product_category") or "",
            instruction=instruction,
            instruction_attributes=tuple(extra.get("instruction_attributes") or ()),
        )
    return products


def synthesize_goals(products: dict[str, Product], seed: int = DEFAULT_SEED) -> list[Goal]:
    """One goal per option combination of every product with an instruction, shuffled with ``seed``."""
    drafts: list[tuple[str, str, tuple[str, ...], tuple[tuple[str, str], ...], float]] = []
    for asin, product in products.items():
        if not product.instruction:
            continue
        ceilings = [p for p in PRICE_STEPS if p > product.price][:4]
        if len(ceilings) >= 2:
            price_upper = max(_seeded_rng(seed, "ceiling", asin).sample(ceilings, 2))
            price_text = f", and price lower than {price_upper:.2f} dollars"
        else:
            price_upper, price_text = NO_PRICE_LIMIT, ""
        names = sorted(product.options)
        for combination in itertools.product(*(product.options[name] for name in names)):
            chosen = tuple(zip(names, combination))
            option_text = ", and ".join(f"{name}: {value}" for name, value in chosen)
            option_text = f" with {option_text}" if option_text else ""
            text = f"{product.instruction}{option_text}{price_text}"
            drafts.append((asin, text, product.instruction_attributes, chosen, price_upper))
    random.Random(seed).shuffle(drafts)
    return [Goal(i, asin, text, attrs, chosen, upper) for i, (asin, text, attrs, chosen, upper) in enumerate(drafts)]


@functools.lru_cache(maxsize=4)
def _load_catalog(root: str, seed: int) -> Catalog:
    products = load_products(Path(root), seed)
    return Catalog(products, synthesize_goals(products, seed), seed, Path(root))


def load_catalog(data_root: str | Path | None = None, seed: int = DEFAULT_SEED) -> Catalog:
    """The catalogue and goals, loaded once per process (environments share it)."""
    root = Path(data_root) if data_root is not None else require_installed("webshop")
    return _load_catalog(str(root.resolve()), int(seed))
