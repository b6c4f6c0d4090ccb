"""WebShop's site in text mode over the generated catalogue: pages, clicks, search and reward.

`GeneratedTextEnv` answers the calls `envs.webshop` makes on WebShop's own text env
(`web_agent_site.envs.web_agent_text_env.WebAgentTextEnv` with `observation_mode="text"`),
with the same results, so the env adapter has one code path for both backends:

    engine.reset(session=goal_index)      -> (page text, None)
    engine.step("click[buy now]")         -> (page text, reward, done, None)
    engine.get_available_actions()        -> {"has_search_bar": bool, "clickables": [...]}
    engine.instruction_text, engine.session,
    engine.server.goals, engine.server.user_sessions[engine.session]
        ("goal", "asin", "options", "keywords", "page", "done", "reward", "verbose_info")

Pages and their text (WebShop's "simple" text mode: the visible strings of the page joined
by " [SEP] "):

    search   WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search
    results  Instruction: [SEP] <instruction> [SEP] Back to Search [SEP] Page 1 (Total results: 50)
             [SEP] Next > [SEP] B09T5VXBJM [SEP] <title> [SEP] $25.99 [SEP] ...   (10 per page)
    item     Instruction: [SEP] <instruction> [SEP] Back to Search [SEP] < Prev [SEP] size [SEP] small
             [SEP] large [SEP] <title> [SEP] Price: $25.99 [SEP] Rating: N.A. [SEP] Description
             [SEP] Features [SEP] Reviews [SEP] Buy Now
    sub page Instruction: [SEP] <instruction> [SEP] Back to Search [SEP] < Prev [SEP] <description
             or one bullet point per part; no reviews>
    done     Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] <reward>

Transitions follow `SimServer.receive`: `search[...]` works from any page (top 50 by BM25,
10 per page, "Next >" shown on every results page); `click[x]` needs x among the page's
clickables (lower-cased button texts, lower-cased product ids, option values) and never
"search"; "< prev" goes from a sub page to its item page, from an item page to its results
page (options are reset there), and from results page k to k - 1; an option click sets that
option; "buy now" ends the episode with the reward. Anything else changes nothing.

Search is BM25 over each product's title, description, first bullet point and option text
(the fields WebShop indexes with Lucene), scored as Lucene scores it with pyserini's k1 = 0.9,
b = 0.4, by `bm25s` (pip install bm25s; `method="lucene"`), on lower-cased alphanumeric
tokens (pyserini's analyzer also stems and drops stop words).

The reward is WebShop's (`get_reward` in `web_agent_site/engine/goal.py`, paper §3.1):

    r = r_type · (attribute matches + option matches + [price <= bound]) / (|attributes| + |options| + 1)

- attribute match: a product attribute with token-set similarity > 85 to the goal
  attribute, or the goal attribute inside the title, bullet points or description;
- option match: a chosen option value with token-set similarity > 85 to the goal's value,
  both first reduced to the first base colour they contain;
- r_type: 1, or 0.5 when neither the search query, two breadcrumb levels nor > 20% of the
  goal title's nouns match; 0.1 below 10% of the nouns; 0 with no noun in common.
Token-set similarity is `rapidfuzz.fuzz.token_set_ratio` on processed strings (lower case,
punctuation to spaces), which is what `thefuzz` >= 0.20 computes (WebShop pins 0.19, whose
pure-Python fallback can differ by a point or two near the threshold). One deliberate
difference: WebShop hands `goal_options.items()` (name, value pairs) to the option matcher
for synthetic goals, comparing a value with a pair; here the goal's option *values* are
compared, what the rule means.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import numpy as np

__all__ = ["webshop_reward", "attribute_matches", "GeneratedServer", "GeneratedTextEnv", "SEARCH_RETURN_N", "PRODUCT_WINDOW"]

SEARCH_RETURN_N = 50
PRODUCT_WINDOW = 10
BUY_NOW, NEXT_PAGE, PREV_PAGE, BACK_TO_SEARCH = "Buy Now", "Next >", "< Prev", "Back to Search"
SUB_PAGES = ("Description", "Features", "Reviews")
SEP = " [SEP] "
_ACTION = re.compile(r"(.+)\[(.+)\]")  # WebShop's parse_action: name[argument]
_TOKEN = re.compile(r"[a-z0-9]+")

# Base colours an option value is reduced to before matching ("navy blue" -> "navy").
_BASE_COLORS = (
    "beige", "black", "blue", "brown", "burgundy", "charcoal", "coral", "cream", "gold", "gray", "green",
    "grey", "ivory", "khaki", "lavender", "light", "navy", "oak", "olive", "orange", "pink", "purple",
    "red", "rose", "silver", "tan", "teal", "walnut", "white", "yellow",
)  # fmt: skip


def _normalize_color(value: str) -> str:
    return next((color for color in _BASE_COLORS if color in value), value)


@functools.lru_cache(maxsize=None)
def _fuzz():
    try:
        from rapidfuzz import fuzz, utils
    except ImportError as err:  # pragma: no cover - declared in the webshop extra
        from .base import EnvUnavailableError

        raise EnvUnavailableError(f"WebShopEnv needs rapidfuzz ({err}). Install: pip install -e '.[webshop]'") from err
    return lambda a, b: fuzz.token_set_ratio(a, b, processor=utils.default_process)


def _type_reward(purchased: dict[str, Any], goal: dict[str, Any]) -> dict[str, Any]:
    query_match = purchased["query"] == goal["query"]
    purchased_levels = {level.strip() for level in purchased["product_category"].split("›")}
    goal_levels = {level.strip() for level in goal["product_category"].split("›")}
    category_match = len(purchased_levels & goal_levels) >= 2
    wanted = set(goal["name_nouns"])
    title_score = len(set(purchased["title_nouns"]) & wanted) / len(wanted) if wanted else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match, "title_score": title_score}


def attribute_matches(purchased: dict[str, Any], goal_attributes: list[str]) -> int:
    ratio = _fuzz()
    text = " ".join([purchased["Title"], *purchased["BulletPoints"], purchased["Description"]]).lower()
    return sum(
        any(ratio(attribute, wanted) > 85 for attribute in purchased["Attributes"]) or wanted in text
        for wanted in goal_attributes
    )


def _option_matches(chosen: list[str], wanted: list[str]) -> int:
    ratio = _fuzz()
    chosen = [_normalize_color(value) for value in chosen]
    return sum(any(ratio(value, _normalize_color(goal)) > 85 for value in chosen) for goal in wanted)


def webshop_reward(
    purchased: dict[str, Any], goal: dict[str, Any], price: float, options: dict[str, str]
) -> tuple[float, dict[str, Any]]:
    """WebShop's reward of buying `purchased` at `price` with `options` for `goal`, and its parts.

    Returns (reward in [0, 1], info) with info holding r_type, r_att, r_option, r_price and
    the weights of the last three, as WebShop's verbose reward info does.
    """
    goal_options = list(goal["goal_options"].values()) if isinstance(goal["goal_options"], dict) else list(goal["goal_options"])
    type_info = _type_reward(purchased, goal)
    attribute_hits = attribute_matches(purchased, goal["attributes"])
    option_hits = _option_matches(list(options.values()), goal_options)
    r_price = price <= goal["price_upper"]
    total = len(goal["attributes"]) + len(goal_options) + 1
    reward = (attribute_hits + option_hits + r_price) / total * type_info["r_type"]
    info = dict(type_info, r_att=attribute_hits / len(goal["attributes"]), w_att=len(goal["attributes"]) / total)
    if goal_options:
        info.update(r_option=option_hits / len(goal_options), w_option=len(goal_options) / total)
    info.update(r_price=r_price, w_price=1 / total)
    return reward, info


class _BM25Index:
    """Top-`SEARCH_RETURN_N` products by Lucene's BM25 (k1 0.9, b 0.4) over the fields WebShop indexes."""

    def __init__(self, products: list[dict[str, Any]]):
        try:
            import bm25s
        except ImportError as err:
            from .base import EnvUnavailableError

            raise EnvUnavailableError(f"WebShopEnv needs bm25s ({err}). Install: pip install -e '.[webshop]'") from err
        documents = []
        for product in products:
            option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product["options"].items())
            text = " ".join([product["Title"], product["Description"], product["BulletPoints"][0], option_text])
            documents.append(_TOKEN.findall(text.lower()))
        self._bm25 = bm25s.BM25(k1=0.9, b=0.4, method="lucene")  # pyserini's defaults
        self._bm25.index(documents, show_progress=False)

    def search(self, keywords: str) -> list[int]:
        tokens = _TOKEN.findall(keywords.lower())
        if not tokens:
            return []
        scores = self._bm25.get_scores(tokens)
        ranked = np.argsort(-scores, kind="stable")[:SEARCH_RETURN_N]  # ties: catalogue order
        return [int(i) for i in ranked if scores[i] > 0]  # Lucene returns only documents that match


class GeneratedServer:
    """The shop behind `GeneratedTextEnv`: products, goals, search index and sessions.

    Read-only but for `user_sessions` (one entry per session id), so envs in one process
    share it, as WebShop's envs can share one `SimServer`.
    """

    def __init__(self, catalog: dict[str, Any]):
        self.all_products = catalog["products"]
        self.product_item_dict = {product["asin"]: product for product in self.all_products}
        self.product_prices = {product["asin"]: product["price"] for product in self.all_products}
        self.goals = catalog["goals"]
        self.search_engine = _BM25Index(self.all_products)
        self.user_sessions: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def new_session(self, session_id: str, goal_index: int) -> dict[str, Any]:
        if not 0 <= goal_index < len(self.goals):
            raise ValueError(f"goal index {goal_index} is out of range: there are {len(self.goals)} goals.")
        session = {
            "goal": self.goals[goal_index],
            "done": False,
            "page_name": "index",
            "keywords": None,
            "page": None,
            "results": [],
            "asin": None,
            "asins": set(),
            "options": {},
            "sub_page": None,
        }
        with self._lock:
            self.user_sessions[session_id] = session
        return session


class GeneratedTextEnv:
    """WebShop's text env (`observation_mode="text"`) over a `GeneratedServer`; see the module docstring.

    Args:
        server: the shared shop.
        session_prefix: prefix of this env's session ids, so envs sharing a server never share
            a session (`reset(session=k)` plays goal k in session `<prefix>k`).
    """

    def __init__(self, server: GeneratedServer, session_prefix: str = ""):
        self.server = server
        self.session_prefix = session_prefix
        self.session: str | None = None
        self.instruction_text = ""

    # -- the calls envs.webshop makes, as on WebAgentTextEnv ------------------------------

    def reset(self, session: int) -> tuple[str, None]:
        self.close()  # one live session per env: a long run must not keep every goal it played
        self.session = f"{self.session_prefix}{session}"
        state = self.server.new_session(self.session, int(session))
        self.instruction_text = state["goal"]["instruction_text"]
        return self.observation, None

    def step(self, action: str) -> tuple[str, float, bool, None]:
        state = self._state
        match = _ACTION.match(action)
        name, argument = (match.group(1), match.group(2).lower()) if match else (action, None)
        reward, done = 0.0, False
        if state["done"]:
            pass  # the purchase is made; the page stays
        elif name == "search" and argument:
            self._search(state, argument, page=1)
        elif name == "click" and argument != "search" and argument in self._clickables(state):
            reward, done = self._click(state, argument)
        return self.observation, reward, done, None

    def get_available_actions(self) -> dict[str, Any]:
        state = self._state
        return {"has_search_bar": state["page_name"] == "index", "clickables": self._clickables(state)}

    def get_instruction_text(self) -> str:
        return self.instruction_text

    @property
    def observation(self) -> str:
        return SEP.join(self._page_parts(self._state))

    def close(self) -> None:
        if self.session is not None:
            self.server.user_sessions.pop(self.session, None)

    # -- pages -----------------------------------------------------------------------------

    @property
    def _state(self) -> dict[str, Any]:
        if self.session is None:
            raise RuntimeError("GeneratedTextEnv: call reset(session=...) first.")
        return self.server.user_sessions[self.session]

    def _search(self, state: dict[str, Any], keywords: str, page: int) -> None:
        state.update(page_name="search_results", keywords=keywords, page=page, asin=None, options={}, sub_page=None)
        state["results"] = [self.server.all_products[i]["asin"] for i in self.server.search_engine.search(keywords)]

    def _shown(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        page = state["page"]
        asins = state["results"][(page - 1) * PRODUCT_WINDOW : page * PRODUCT_WINDOW]
        return [self.server.product_item_dict[asin] for asin in asins]

    def _click(self, state: dict[str, Any], clickable: str) -> tuple[float, bool]:
        page_name = state["page_name"]
        if clickable == BUY_NOW.lower():
            product = self.server.product_item_dict[state["asin"]]
            reward, info = webshop_reward(product, state["goal"], self.server.product_prices[state["asin"]], state["options"])
            state.update(page_name="done", done=True, reward=reward, verbose_info=info)
            return reward, True
        if clickable == BACK_TO_SEARCH.lower():
            state.update(page_name="index", keywords=None, page=None, asin=None, options={}, sub_page=None)
        elif page_name == "search_results" and clickable in (NEXT_PAGE.lower(), PREV_PAGE.lower()):
            step = 1 if clickable == NEXT_PAGE.lower() else -1
            state["page"] += step  # results stay those of the same keywords
            state.update(asin=None, options={})
        elif page_name == "item_sub_page" and clickable == PREV_PAGE.lower():
            state.update(page_name="item_page", sub_page=None)
        elif page_name == "item_page" and clickable == PREV_PAGE.lower():
            self._search(state, state["keywords"], state["page"])
        elif clickable in {sub.lower() for sub in SUB_PAGES}:
            state.update(page_name="item_sub_page", sub_page=clickable)
        elif page_name == "search_results":  # a product id
            state.update(page_name="item_page", asin=clickable.upper())
            state["asins"].add(state["asin"])
        else:  # an option value of the item page
            product = self.server.product_item_dict[state["asin"]]
            name = next(n for n, values in product["options"].items() if clickable in values)
            state["options"][name] = clickable
        return 0.0, False

    def _clickables(self, state: dict[str, Any]) -> list[str]:
        page_name = state["page_name"]
        if page_name == "index":
            return ["search"]
        if page_name == "done":
            return []
        buttons = [BACK_TO_SEARCH]
        if page_name == "search_results":
            buttons += ([PREV_PAGE] if state["page"] > 1 else []) + [NEXT_PAGE]
            return [b.lower() for b in buttons] + [p["asin"].lower() for p in self._shown(state)]
        buttons.append(PREV_PAGE)
        if page_name == "item_sub_page":
            return [b.lower() for b in buttons]
        buttons += [*SUB_PAGES, BUY_NOW]
        product = self.server.product_item_dict[state["asin"]]
        return [b.lower() for b in buttons] + [v for values in product["options"].values() for v in values]

    def _page_parts(self, state: dict[str, Any]) -> list[str]:
        page_name = state["page_name"]
        instruction = ["Instruction:", self.instruction_text]
        if page_name == "index":
            return ["WebShop", *instruction, "Search"]
        if page_name == "done":
            return ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", str(state["reward"])]
        if page_name == "search_results":
            page = state["page"]
            parts = [*instruction, BACK_TO_SEARCH, f"Page {page} (Total results: {len(state['results'])})"]
            parts += ([PREV_PAGE] if page > 1 else []) + [NEXT_PAGE]
            for product in self._shown(state):
                parts += [product["asin"], product["Title"], product["Price"]]
            return parts
        product = self.server.product_item_dict[state["asin"]]
        parts = [*instruction, BACK_TO_SEARCH, PREV_PAGE]
        if page_name == "item_sub_page":
            if state["sub_page"] == "description":
                parts.append(product["Description"])
            elif state["sub_page"] == "features":
                parts += product["BulletPoints"]
            return parts  # reviews: the generated products have none
        for name, values in product["options"].items():
            parts += [name, *values]
        return parts + [product["Title"], f"Price: {product['Price']}", "Rating: N.A.", *SUB_PAGES, BUY_NOW]
