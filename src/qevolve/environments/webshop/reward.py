"""The WebShop purchase reward, with its breakdown.

    reward = r_type * (attribute matches + option matches + price ok) / (#goal attributes + #goal options + 1)

* ``r_type`` (is it the right kind of product?) starts at 1; it drops to 0.5 when none of
  query match, category match (the two breadcrumbs share at least two levels) or title score > 0.2
  holds; to 0.1 when the title score is below 0.1; to 0 when it is 0. The title score is the share
  of the goal title's nouns that the purchased title also has (0.2 when the goal title has none).
* an attribute the goal asks for matches when a product attribute is a fuzzy match
  (``token_set_ratio > 85``) or the attribute is a substring of the purchased product's title,
  bullet points or description (all lower-cased);
* a goal option matches when a chosen option value is a fuzzy match, both normalised first to a
  base colour word when they name one;
* the price is ok when the purchase costs at most the goal's ceiling.

Success is reward == 1. Fuzzy matching reproduces ``thefuzz.fuzz.token_set_ratio`` (which drops
characters U+0080..U+00FF, lower-cases and turns punctuation into spaces, then rounds the
rapidfuzz score to an integer).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Mapping

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from qevolve.environments.webshop.catalog import Goal, Product

FUZZY_THRESHOLD = 85  # a match needs a score strictly above this
TITLE_NOUNS_FILE = "title_nouns.json"

# Base colour words, alphabetical; an option value that contains one (as a word) is normalised to
# the first of them it contains. Our own list (upstream's differs in detail, see docs/webshop.md).
BASE_COLOURS = (
    "beige", "black", "blue", "bronze", "brown", "burgundy", "camel", "charcoal", "coral", "cream",
    "gold", "gray", "green", "grey", "ivory", "khaki", "lavender", "maroon", "mint", "navy", "nude",
    "olive", "orange", "pink", "purple", "red", "rose", "silver", "tan", "teal", "turquoise",
    "violet", "white", "wine", "yellow",
)
_LATIN1_SUPPLEMENT = {i: None for i in range(128, 256)}


@functools.lru_cache(maxsize=1)
def title_nouns() -> dict[str, list[str]]:
    """asin -> nouns of its title (precomputed by scripts/precompute_webshop_title_nouns.py)."""
    text = resources.files("qevolve.environments.webshop").joinpath(TITLE_NOUNS_FILE).read_text(encoding="utf-8")
    return json.loads(text)["nouns"]


def _process(text: str) -> str:
    return default_process(text.translate(_LATIN1_SUPPLEMENT))


@functools.lru_cache(maxsize=100_000)
def fuzzy_score(a: str, b: str) -> int:
    """thefuzz's token_set_ratio: 0..100."""
    return int(round(fuzz.token_set_ratio(_process(a), _process(b))))


def normalize_colour(value: str) -> str:
    words = set(_process(value).split())
    for colour in BASE_COLOURS:
        if colour in words:
            return colour
    return value


def _goal_option_key(name: str, value: str, upstream_tuples: bool) -> str:
    """What a goal option is compared as.

    Upstream compared the (name, value) *tuple* of a synthetic goal option: colour normalisation
    then only fired on an exact colour value, and fuzzy matching saw the text of the tuple, name
    included, so any chosen value whose words all occur in "name value" matched (token_set_ratio
    is 100 when one side's words are a subset of the other's).
    """
    if not upstream_tuples:
        return normalize_colour(value)
    for colour in BASE_COLOURS:
        if colour in (name, value):
            return colour
    return str((name, value))


@dataclass(frozen=True)
class RewardBreakdown:
    reward: float
    r_type: float
    query_match: bool
    category_match: bool
    title_score: float
    attribute_matches: int
    goal_attributes: int
    option_matches: int
    goal_options: int
    price_ok: bool
    price: float
    price_upper: float

    def as_dict(self) -> dict:
        return asdict(self)


def type_score(purchased: Product, target: Product,
               nouns: Mapping[str, list[str]] | None = None) -> tuple[float, bool, bool, float]:
    """(r_type, query match, category match, title score); ``nouns``: asin -> title nouns."""
    query_match = purchased.query == target.query
    purchased_levels = {level.strip() for level in purchased.product_category.split("›")}
    target_levels = {level.strip() for level in target.product_category.split("›")}
    category_match = len(purchased_levels & target_levels) >= 2
    nouns = title_nouns() if nouns is None else nouns
    goal_nouns = nouns.get(target.asin, [])
    purchased_nouns = set(nouns.get(purchased.asin, []))
    title_score = len(purchased_nouns & set(goal_nouns)) / len(goal_nouns) if goal_nouns else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_matches(purchased: Product, goal_attributes: tuple[str, ...]) -> int:
    text_fields = (purchased.title.lower(), " ".join(purchased.bullet_points).lower(), purchased.description.lower())
    count = 0
    for wanted in goal_attributes:
        if any(fuzzy_score(have, wanted) > FUZZY_THRESHOLD for have in purchased.attributes):
            count += 1
        elif any(wanted in field for field in text_fields):
            count += 1
    return count


def option_matches(chosen: Mapping[str, str], goal_options: tuple[tuple[str, str], ...],
                   upstream_tuples: bool = False) -> int:
    chosen_values = [normalize_colour(v) for v in chosen.values()]
    count = 0
    for name, value in goal_options:
        wanted = _goal_option_key(name, value, upstream_tuples)
        if any(fuzzy_score(have, wanted) > FUZZY_THRESHOLD for have in chosen_values):
            count += 1
    return count


def purchase_reward(purchased: Product, goal: Goal, target: Product, chosen: Mapping[str, str],
                    upstream_option_matching: bool = False,
                    nouns: Mapping[str, list[str]] | None = None) -> RewardBreakdown:
    """The reward of buying ``purchased`` with options ``chosen`` (name -> value) for ``goal``."""
    r_type, query_match, category_match, title_score = type_score(purchased, target, nouns)
    attrs = attribute_matches(purchased, goal.attributes)
    options = option_matches(chosen, goal.options, upstream_option_matching)
    price_ok = purchased.price <= goal.price_upper
    denominator = len(goal.attributes) + len(goal.options) + 1
    reward = r_type * (attrs + options + int(price_ok)) / denominator
    return RewardBreakdown(reward, r_type, query_match, category_match, title_score, attrs, len(goal.attributes),
                           options, len(goal.options), price_ok, purchased.price, goal.price_upper)
