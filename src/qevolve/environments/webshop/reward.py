"""The WebShop purchase reward, with its breakdown: a re-implementation of upstream's ``goal.py`` rules.

    reward = r_type * (attribute matches + option matches + price ok) / (#goal attributes + #goal options + 1)

* ``r_type`` (is it the right kind of product?) starts at 1; it drops to 0.5 when none of
  query match, category match (the two breadcrumbs share at least two levels) or title score > 0.2
  holds; to 0.1 when the title score is below 0.1; to 0 when it is 0. The title score is the share
  of the goal title's nouns that the purchased title also has (0.2 when the goal title has none).
* an attribute the goal asks for matches when a product attribute is a fuzzy match
  (``token_set_ratio > 85``) or the attribute is a substring of the purchased product's title,
  bullet points or description (all lower-cased);
* a goal option matches when a chosen option value is a fuzzy match of it. By default
  (``option_matching="upstream"``) this is upstream's exact rule: each chosen value is replaced by
  the first of WebShop's 101 colour words (``UPSTREAM_COLOURS``) that is a *substring* of it, and
  the goal option is its ``(name, value)`` pair, replaced by a colour word only when the name or
  the value *is* one, else compared as the text of the pair (``"('size', 'x-large')"``, name
  included). ``option_matching="by_value"`` (this project's earlier, more lenient default)
  compares values with values, both normalised to the first of 35 base colour words
  (``BASE_COLOURS``) they contain as a whole word;
* the price is ok when the purchase costs at most the goal's ceiling.

Success is reward == 1. Under the upstream rule a perfect purchase (the target with the goal's
options) does not always reach 1: a chosen "standard" normalises to "tan" and no longer matches
"size standard" (see :func:`best_reward`, and docs/webshop.md for how often). Fuzzy matching
reproduces ``thefuzz.fuzz.token_set_ratio`` (which drops characters U+0080..U+00FF, lower-cases
and turns punctuation into spaces, then rounds the rapidfuzz score to an integer).
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Mapping

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from qevolve.environments.webshop.catalog import Goal, Product

FUZZY_THRESHOLD = 85  # a match needs a score strictly above this
TITLE_NOUNS_FILE = "title_nouns.json"

OPTION_MATCHING = ("upstream", "by_value")  # settings of ``option_matching``, the default first

# WebShop's colour words (``COLOR_SET`` of upstream's web_agent_site/engine/normalize.py), in its
# order, which decides the word a value normalises to ("dark brown" -> "brown", "washed" -> "ash").
UPSTREAM_COLOURS = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal",
    "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite",
    "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon",
    "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha",
    "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink",
    "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger", "turquoise",
    "violet", "walnut", "wheat", "white", "wine", "yellow",
)
# Base colour words of the ``by_value`` rule, alphabetical (our own list); a value that contains
# one as a word is normalised to the first of them it contains.
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
    """The ``by_value`` rule: the first base colour word the value contains as a word, else the value."""
    words = set(_process(value).split())
    for colour in BASE_COLOURS:
        if colour in words:
            return colour
    return value


def upstream_colour(value: str) -> str:
    """Upstream's rule for a chosen value: the first of its colour words that is a substring of it."""
    for colour in UPSTREAM_COLOURS:
        if colour in value:
            return colour
    return value


def upstream_goal_option(name: str, value: str) -> str:
    """What upstream compares a goal option ``(name, value)`` with.

    Upstream normalised the pair itself: ``colour in (name, value)`` holds only when the name or
    the value *equals* a colour word; otherwise the pair stays, and the fuzzy matcher sees the
    text of the tuple, name included, which its pre-processing turns into the words of both.
    """
    for colour in UPSTREAM_COLOURS:
        if colour == name or colour == value:
            return colour
    return str((name, value))


def check_option_matching(option_matching: str) -> str:
    if option_matching not in OPTION_MATCHING:
        raise ValueError(f"webshop option_matching {option_matching!r}: expected one of {', '.join(OPTION_MATCHING)}")
    return option_matching


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
                   option_matching: str = "upstream") -> int:
    """How many goal options some chosen option value matches (``option_matching``: see the module)."""
    check_option_matching(option_matching)
    if option_matching == "upstream":
        chosen_values = [upstream_colour(v) for v in chosen.values()]
        wanted = [upstream_goal_option(name, value) for name, value in goal_options]
    else:
        chosen_values = [normalize_colour(v) for v in chosen.values()]
        wanted = [normalize_colour(value) for _, value in goal_options]
    return sum(any(fuzzy_score(have, key) > FUZZY_THRESHOLD for have in chosen_values) for key in wanted)


def purchase_reward(purchased: Product, goal: Goal, target: Product, chosen: Mapping[str, str],
                    option_matching: str = "upstream",
                    nouns: Mapping[str, list[str]] | None = None) -> RewardBreakdown:
    """The reward of buying ``purchased`` with options ``chosen`` (name -> value) for ``goal``."""
    r_type, query_match, category_match, title_score = type_score(purchased, target, nouns)
    attrs = attribute_matches(purchased, goal.attributes)
    options = option_matches(chosen, goal.options, option_matching)
    price_ok = purchased.price <= goal.price_upper
    denominator = len(goal.attributes) + len(goal.options) + 1
    reward = r_type * (attrs + options + int(price_ok)) / denominator
    return RewardBreakdown(reward, r_type, query_match, category_match, title_score, attrs, len(goal.attributes),
                           options, len(goal.options), price_ok, purchased.price, goal.price_upper)


def best_reward(goal: Goal, target: Product, option_matching: str = "upstream",
                nouns: Mapping[str, list[str]] | None = None) -> tuple[float, float]:
    """(reward of the perfect purchase, best reward over every option choice of the target).

    The perfect purchase buys the target with exactly the goal's options.
    """
    perfect = purchase_reward(target, goal, target, dict(goal.options), option_matching, nouns).reward
    best = perfect
    if perfect < 1.0:
        names = sorted(target.options)
        for combination in itertools.product(*(target.options[name] for name in names)):
            chosen = dict(zip(names, combination))
            best = max(best, purchase_reward(target, goal, target, chosen, option_matching, nouns).reward)
            if best == 1.0:
                break
    return perfect, best
