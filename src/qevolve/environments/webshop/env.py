"""The WebShop environment in text mode: search, results, item pages, Buy Now.

Pages are rendered directly as the text WebShop's text mode shows (its visible parts joined by
" [SEP] "), with no HTML and no web server. Actions are ``search[keywords]`` (from any page) and
``click[x]`` where x is something clickable on the current page (case-insensitive); anything else
is an invalid action: the page stays as it is and the reward is 0. The episode ends at Buy Now
with the purchase reward of :mod:`qevolve.environments.webshop.reward`.

Task ids are ``goal-<index>`` over the 6,910 synthetic goals (shuffled with seed 233). Splits:
``test`` = goals 0..499 (the ETO-style papers report the first 200), ``validation`` = 500..1499,
``train`` = 1500..6909, ``all``; the boundaries are settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from qevolve.environments.base import Environment, StepResult, register_environment
from qevolve.environments.webshop.catalog import (DATA_FILES, DEFAULT_SEED, Catalog, Goal, Product, goal_index,
                                                  goal_task_id, load_catalog)
from qevolve.environments.webshop.prompt import WEBSHOP_INSTRUCTION
from qevolve.environments.webshop.reward import RewardBreakdown, check_option_matching, purchase_reward

SEP = " [SEP] "
RESULTS_PER_PAGE = 10
TOP_K = 50  # search results kept (5 pages)
DEFAULT_MAX_TURNS = 10  # the ETO protocol's limit for WebShop
DEFAULT_TEST_GOALS = 500
DEFAULT_VALIDATION_GOALS = 1000
SPLIT_NAMES = ("test", "validation", "train", "all")

# Button texts as shown; clicking compares lower-cased text.
BACK_TO_SEARCH = "Back to Search"
NEXT_PAGE = "Next >"
PREV_PAGE = "< Prev"
BUY_NOW = "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")
SEARCH_TEMPLATE = "search[<keywords>]"

_ACTION_RE = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)


_ASIN = re.compile(r"^b0[0-9a-z]{8}$")
_BUTTON_KINDS = {"buy now": "click[buy now]", "< prev": "click[< prev]", "next >": "click[next >]",
                 "back to search": "click[back to search]", "description": "click[description]",
                 "features": "click[features]", "reviews": "click[reviews]"}


def parse_action(action: str) -> tuple[str, str] | None:
    """``"click[Buy Now]"`` -> ``("click", "buy now")``; None when it is neither form."""
    match = _ACTION_RE.match(action)
    if not match:
        return None
    return match.group(1).lower(), match.group(2).strip().lower()


@dataclass
class Session:
    """Where the shopper is: the page, the last search, the open product and chosen options."""

    goal: Goal
    page: str = "search"  # search | results | item | description | features | reviews | done
    query: str = ""
    results: list[str] = field(default_factory=list)  # ASINs, best first
    page_number: int = 1
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)  # option name -> chosen value
    reward: RewardBreakdown | None = None


@register_environment("webshop")
class WebShopEnv(Environment):
    """WebShop (1,000 products) in text mode.

    ``split`` is where ``tasks()`` looks by default; ``seed`` seeds the goal shuffle and every
    other random draw (233, as upstream's shuffle); ``option_matching`` is how chosen options are
    scored: ``"upstream"`` (upstream's exact rule, the default) or ``"by_value"`` (the earlier,
    more lenient rule), see :mod:`qevolve.environments.webshop.reward`.
    """

    name = "webshop"
    turn_format = "thought_action"  # the oracle's demonstrations are Thought:/Action: turns
    instruction = WEBSHOP_INSTRUCTION
    # r_aux of the critic's reward: the paper's table (docs/method.md, section 3), which penalises only a
    # malformed turn here
    retrospective_penalties = {"format_error": -0.3, "invalid_action": 0.0, "repeat": 0.0}
    data_files = DATA_FILES

    @staticmethod
    def action_kind(action: str) -> str:
        """``search``, a button (``click[buy now]``, ``click[< prev]``, ...), ``click[product]`` (an ASIN) or
        ``click[option]``; ``(unparsed)`` for text that is not an action."""
        parsed = parse_action(action)
        if parsed is None:
            return "(unparsed)"
        verb, argument = parsed
        if verb == "search":
            return "search"
        if argument in _BUTTON_KINDS:
            return _BUTTON_KINDS[argument]
        return "click[product]" if _ASIN.match(argument) else "click[option]"

    def __init__(self, split: str = "train", data_root: str | Path | None = None, max_turns: int = DEFAULT_MAX_TURNS,
                 seed: int = DEFAULT_SEED, test_goals: int = DEFAULT_TEST_GOALS,
                 validation_goals: int = DEFAULT_VALIDATION_GOALS, option_matching: str = "upstream",
                 top_k: int = TOP_K):
        if max_turns < 1:
            raise ValueError(f"webshop max_turns must be >= 1, got {max_turns}")
        if test_goals < 0 or validation_goals < 0:
            raise ValueError(f"webshop test_goals/validation_goals must be >= 0, got {test_goals}/{validation_goals}")
        self.catalog: Catalog = load_catalog(data_root, seed)
        if test_goals + validation_goals > len(self.catalog.goals):
            raise ValueError(f"webshop test_goals + validation_goals = {test_goals + validation_goals} exceeds the "
                             f"{len(self.catalog.goals)} goals")
        self.index = self.catalog.search_index  # built once per process, shared by every instance
        self.default_split = split
        self._max_turns = max_turns
        self.test_goals = test_goals
        self.validation_goals = validation_goals
        self.option_matching = check_option_matching(option_matching)
        self.top_k = top_k
        self.session: Session | None = None
        self.tasks(split)  # validates the split name

    # -- tasks ----------------------------------------------------------------------------------

    def split_range(self, split: str) -> range:
        n, test_end = len(self.catalog.goals), self.test_goals
        validation_end = test_end + self.validation_goals
        ranges = {"test": range(0, test_end), "validation": range(test_end, validation_end),
                  "train": range(validation_end, n), "all": range(0, n)}
        if split not in ranges:
            raise ValueError(f"WebShop split {split!r}: expected one of {', '.join(SPLIT_NAMES)}")
        return ranges[split]

    def tasks(self, split: str) -> list[str]:
        return [goal_task_id(i) for i in self.split_range(split)]

    def max_turns(self, task_id: str | None = None) -> int:
        return self._max_turns

    def goal_of(self, task_id: str) -> Goal:
        index = goal_index(task_id)
        if not 0 <= index < len(self.catalog.goals):
            raise ValueError(f"WebShop task {task_id!r}: goal index out of range 0..{len(self.catalog.goals) - 1}")
        return self.catalog.goals[index]

    @property
    def goal(self) -> Goal:
        if self.session is None:
            raise RuntimeError("no task: call reset() first")
        return self.session.goal

    # -- episode --------------------------------------------------------------------------------

    def reset(self, task_id: str) -> str:
        self.session = Session(self.goal_of(task_id))
        return self.render()

    def step(self, action: str) -> StepResult:
        if self.session is None:
            raise RuntimeError("step() before reset()")
        session = self.session
        if session.page == "done":
            return StepResult(self.render(), 0.0, True, self._info(valid=False))
        parsed = parse_action(action)
        valid = parsed is not None and self._apply(*parsed)
        if session.page == "done":
            assert session.reward is not None
            return StepResult(self.render(), session.reward.reward, True, self._info(valid=True))
        return StepResult(self.render(), 0.0, False, self._info(valid=valid))

    def _info(self, valid: bool) -> dict:
        session = self.session
        assert session is not None
        info: dict = {"valid_action": valid, "page": session.page}
        if session.reward is None:
            info.update(won=False, score=0.0)
        else:
            info.update(won=session.reward.reward == 1.0, score=session.reward.reward,
                        reward_breakdown=session.reward.as_dict(), purchased=session.asin,
                        purchased_options=dict(session.options), target=session.goal.asin)
        return info

    def _apply(self, verb: str, argument: str) -> bool:
        """Carry out one parsed action; False (and no change) when it is not available."""
        session = self.session
        assert session is not None
        if verb == "search":
            if not argument:
                return False
            session.query = argument
            session.results = [hit.doc_id for hit in self.index.search(argument, self.top_k)]
            session.page, session.page_number, session.asin, session.options = "results", 1, None, {}
            return True
        if argument not in self.clickables():
            return False
        if argument == BACK_TO_SEARCH.lower():
            session.page, session.query, session.results, session.asin, session.options = "search", "", [], None, {}
        elif argument == NEXT_PAGE.lower():
            session.page_number += 1
        elif argument == PREV_PAGE.lower():
            if session.page == "results":
                session.page_number -= 1
            elif session.page == "item":  # back to the results; the chosen options are forgotten
                session.page, session.asin, session.options = "results", None, {}
            else:  # a description/features/reviews page: back to the item, options kept
                session.page = "item"
        elif session.page == "results":
            session.page, session.asin, session.options = "item", argument.upper(), {}
        elif argument in (p.lower() for p in SUB_PAGES):
            session.page = argument
        elif argument == BUY_NOW.lower():
            product = self.catalog.products[session.asin]
            target = self.catalog.products[session.goal.asin]
            session.reward = purchase_reward(product, session.goal, target, session.options,
                                             self.option_matching)
            session.page = "done"
        else:  # an option value
            product = self.catalog.products[session.asin]
            for name, values in product.options.items():
                if argument in values:
                    session.options[name] = argument
                    break
        return True

    # -- pages ----------------------------------------------------------------------------------

    def _visible_results(self) -> list[str]:
        session = self.session
        assert session is not None
        start = (session.page_number - 1) * RESULTS_PER_PAGE
        return session.results[start:start + RESULTS_PER_PAGE]

    def _has_next_page(self) -> bool:
        session = self.session
        assert session is not None
        return session.page_number * RESULTS_PER_PAGE < len(session.results)

    def clickables(self) -> list[str]:
        """Lower-cased texts that ``click[...]`` accepts on the current page."""
        session = self.session
        if session is None or session.page in ("search", "done"):
            return []
        buttons = [BACK_TO_SEARCH.lower()]
        if session.page == "results":
            if session.page_number > 1:
                buttons.append(PREV_PAGE.lower())
            if self._has_next_page():
                buttons.append(NEXT_PAGE.lower())
            buttons += [asin.lower() for asin in self._visible_results()]
        elif session.page == "item":
            product = self.catalog.products[session.asin]
            buttons.append(PREV_PAGE.lower())
            buttons += [value for values in product.options.values() for value in values]
            buttons += [p.lower() for p in SUB_PAGES] + [BUY_NOW.lower()]
        else:
            buttons.append(PREV_PAGE.lower())
        return list(dict.fromkeys(buttons))

    def admissible_actions(self) -> list[str]:
        """click[...] for every clickable of the page, and the search template on the search page."""
        session = self.session
        if session is None or session.page == "done":
            return []
        if session.page == "search":
            return [SEARCH_TEMPLATE]
        return [f"click[{text}]" for text in self.clickables()]

    def render(self) -> str:
        session = self.session
        assert session is not None
        instruction = session.goal.instruction
        if session.page == "search":
            return SEP.join(["WebShop", "Instruction:", instruction, "Search"])
        head = ["Instruction:", instruction, BACK_TO_SEARCH]
        if session.page == "results":
            parts = head + [f"Page {session.page_number} (Total results: {len(session.results)})"]
            if session.page_number > 1:
                parts.append(PREV_PAGE)
            if self._has_next_page():
                parts.append(NEXT_PAGE)
            for asin in self._visible_results():
                product = self.catalog.products[asin]
                parts += [asin, product.title, product.price_tag]
            return SEP.join(parts)
        product = self.catalog.products[session.asin] if session.asin else None
        if session.page == "done":
            return self._render_done(product)
        assert product is not None
        parts = head + [PREV_PAGE]
        if session.page == "item":
            for name, values in product.options.items():
                parts += [name, *values]
            parts += [product.title, f"Price: {product.price_tag}", "Rating: N.A.", *SUB_PAGES, BUY_NOW]
        elif session.page == "description":
            parts.append(product.description)
        elif session.page == "features":
            parts += list(product.bullet_points)
        # reviews: the catalogue has none
        return SEP.join(parts)

    def _render_done(self, product: Product | None) -> str:
        session = self.session
        assert session is not None and session.reward is not None and product is not None
        chosen = ", ".join(f"{name}: {value}" for name, value in session.options.items()) or "none"
        return SEP.join(["Thank you for shopping with us!", "Purchased", product.asin, product.title,
                         "Options", chosen, "Your score (min 0.0, max 1.0)", f"{session.reward.reward:.4f}"])

    def close(self) -> None:
        self.session = None
