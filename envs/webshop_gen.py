"""A deterministic WebShop-like product catalogue and its instructions, generated offline.

WebShop (Yao et al., 2022, https://arxiv.org/abs/2207.01206) scraped 1.18M Amazon products
and annotated their attributes; its engine needs that data and a Lucene index, neither of
which can be fetched here. This module generates a stand-in with the same *shape*, so the
env's offline backend (`envs.webshop`, `source="generated"`) plays WebShop's pages and
reward rules on it:

- five categories as WebShop's (beauty, electronics, fashion, food, furniture), six product
  types each. A type has WebShop's per-product fields: the search `query` it was scraped
  for, a `product_category` breadcrumb ("Beauty & Personal Care › Hair Care › ..."), a pool
  of attribute phrases ("sulfate free", "long lasting") and option dimensions (color,
  size, scent, flavor name...) with their values;
- a product draws a brand, 3-5 attributes, 0-2 option dimensions with 2-4 values each, and a
  price (a single price or a "$lo to $hi" range, as WebShop lists them); its title, description
  and bullet points (the "Features" page) are written from those;
- instructions are drawn as WebShop draws its synthetic goals (`get_synthetic_goals` in
  `web_agent_site/engine/goal.py`): per product an instruction over 1-3 of its attributes,
  one goal per combination of its option values (" with color: navy, and size: large"),
  and a price bound drawn from the next four multiples of $10 above the product's price
  (", and price lower than 40.00 dollars"). Goals are then shuffled with a fixed seed.

Everything is a function of (`GENERATOR_VERSION`, seed, num_products) and is cached as
one JSON file under `$BIPACE_CACHE/webshop` (default `~/.cache/bipace_trainer/webshop`),
as the generated ALFWorld games are. Generating 1,000 products takes well under a second;
the cache mostly spares every worker process the same work.

Differences from the real data, by construction: titles are shorter and regular, there are
no reviews or images, and the words the type reward compares (WebShop takes the nouns of the
titles from spaCy) are recorded per product at generation (`title_nouns`: brand and type
nouns) instead of parsed.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["GENERATOR_VERSION", "CATEGORIES", "generate_catalog", "load_catalog", "default_cache_dir"]

GENERATOR_VERSION = 1
PRICE_STEPS = [10.0 * i for i in range(1, 100)]  # WebShop's PRICE_RANGE: bounds are multiples of $10

_COLORS = [
    "black", "white", "navy blue", "gray", "red", "pink", "beige", "brown", "green", "light blue",
    "purple", "khaki", "burgundy", "ivory", "teal", "silver", "gold", "olive", "charcoal", "coral",
]  # fmt: skip
_SHOE_SIZES = ["6", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12", "13"]
_CLOTHING_SIZES = ["x-small", "small", "medium", "large", "x-large", "xx-large"]

# One entry per product type: (category, query, breadcrumb, title phrase, type nouns, attributes,
# option dimensions, price range). Attribute phrases and option names follow WebShop's data.
_TYPES: list[dict[str, Any]] = [
    # beauty
    dict(category="beauty", query="shampoo", phrase="Shampoo", nouns=["shampoo"],
         breadcrumb="Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
         attributes=["sulfate free", "paraben free", "natural ingredients", "dry hair", "hair growth",
                     "cruelty free", "damaged hair", "long lasting"],
         options={"scent": ["lavender", "coconut", "rose", "mint", "citrus", "argan oil"],
                  "size": ["8.4 fl oz", "12 fl oz", "16.9 fl oz", "33.8 fl oz"]}, price=(6, 38)),
    dict(category="beauty", query="face moisturizer", phrase="Face Moisturizer", nouns=["face", "moisturizer"],
         breadcrumb="Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
         attributes=["hyaluronic acid", "fine lines", "sensitive skin", "oil free", "fragrance free",
                     "dark spots", "anti aging", "non greasy"],
         options={"size": ["1.7 ounce", "2.5 ounce", "3.4 ounce"], "style": ["day cream", "night cream", "gel cream"]},
         price=(9, 60)),
    dict(category="beauty", query="nail polish", phrase="Nail Polish", nouns=["nail", "polish"],
         breadcrumb="Beauty & Personal Care › Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
         attributes=["long lasting", "quick drying", "non toxic", "high gloss", "easy apply", "nail art"],
         options={"color": _COLORS}, price=(4, 22)),
    dict(category="beauty", query="lipstick", phrase="Matte Lipstick", nouns=["lipstick"],
         breadcrumb="Beauty & Personal Care › Makeup › Lips › Lipstick",
         attributes=["long lasting", "highly pigmented", "cruelty free", "moisturizing", "easy carry", "waterproof"],
         options={"color": _COLORS}, price=(5, 28)),
    dict(category="beauty", query="clip in hair extensions", phrase="Clip in Hair Extensions",
         nouns=["clip", "hair", "extensions"],
         breadcrumb="Beauty & Personal Care › Hair Care › Hair Extensions, Wigs & Accessories › Extensions",
         attributes=["natural looking", "heat resistant", "high quality", "easy to use", "human hair", "synthetic hair"],
         options={"color": _COLORS[:10], "size": ["14 inch", "18 inch", "22 inch", "26 inch"]}, price=(15, 90)),
    dict(category="beauty", query="electric toothbrush", phrase="Electric Toothbrush", nouns=["toothbrush"],
         breadcrumb="Beauty & Personal Care › Oral Care › Toothbrushes & Accessories › Electric Toothbrushes",
         attributes=["rechargeable", "long battery life", "sensitive teeth", "travel case", "easy clean",
                     "waterproof"],
         options={"color": ["black", "white", "pink", "light blue", "green"], "size": ["1 pack", "2 pack"]},
         price=(19, 95)),
    # electronics
    dict(category="electronics", query="bluetooth headphones", phrase="Bluetooth Headphones",
         nouns=["bluetooth", "headphones"],
         breadcrumb="Electronics › Headphones, Earbuds & Accessories › Headphones › Over-Ear Headphones",
         attributes=["noise cancelling", "wireless bluetooth", "long battery life", "hands free",
                     "high definition", "fast charging", "water resistant"],
         options={"color": ["black", "white", "navy blue", "gray", "red", "beige"]}, price=(18, 180)),
    dict(category="electronics", query="iphone case", phrase="Phone Case", nouns=["phone", "case"],
         breadcrumb="Electronics › Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
         attributes=["shockproof", "wireless charging", "heavy duty", "slim fit", "tempered glass", "easy install"],
         options={"color": _COLORS[:12], "size": ["iphone 13", "iphone 14", "iphone 15", "iphone 15 pro max"]},
         price=(6, 30)),
    dict(category="electronics", query="usb c cable", phrase="USB C Cable", nouns=["usb", "cable"],
         breadcrumb="Electronics › Computers & Accessories › Computer Accessories & Peripherals › Cables",
         attributes=["fast charging", "high speed", "gold plated", "braided nylon", "data transfer", "durable"],
         options={"size": ["3 ft", "6 ft", "10 ft"], "color": ["black", "white", "gray", "red"]}, price=(5, 25)),
    dict(category="electronics", query="security camera", phrase="Security Camera", nouns=["security", "camera"],
         breadcrumb="Electronics › Camera & Photo › Video Surveillance › Surveillance Cameras",
         attributes=["night vision", "motion detection", "two way audio", "high definition", "easy install",
                     "weatherproof"],
         options={"size": ["1 pack", "2 pack", "4 pack"]}, price=(25, 160)),
    dict(category="electronics", query="portable bluetooth speaker", phrase="Portable Speaker",
         nouns=["speaker"],
         breadcrumb="Electronics › Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
         attributes=["waterproof", "long battery life", "stereo sound", "wireless bluetooth", "easy carry",
                     "built in microphone"],
         options={"color": ["black", "navy blue", "red", "green", "gray", "teal"]}, price=(15, 120)),
    dict(category="electronics", query="tv wall mount", phrase="TV Wall Mount", nouns=["tv", "wall", "mount"],
         breadcrumb="Electronics › Television & Video › Accessories › TV Mounts, Stands & Turntables",
         attributes=["heavy duty", "easy install", "full motion", "tilt", "cable management", "space saving"],
         options={"size": ["32-55 inch", "42-70 inch", "55-85 inch"]}, price=(16, 90)),
    # fashion
    dict(category="fashion", query="men's running shoes", phrase="Men's Running Shoes", nouns=["men", "shoes"],
         breadcrumb="Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
         attributes=["non slip", "rubber sole", "lace up", "breathable", "memory foam", "arch support",
                     "lightweight"],
         options={"color": _COLORS[:10], "size": _SHOE_SIZES}, price=(25, 120)),
    dict(category="fashion", query="women's summer dress", phrase="Women's Summer Dress", nouns=["women", "dress"],
         breadcrumb="Clothing, Shoes & Jewelry › Women › Clothing › Dresses › Casual",
         attributes=["machine wash", "short sleeve", "polyester spandex", "loose fit", "high waist",
                     "soft material", "daily wear"],
         options={"color": _COLORS, "size": _CLOTHING_SIZES}, price=(14, 60)),
    dict(category="fashion", query="men's t-shirt", phrase="Men's T-Shirt", nouns=["men", "shirt"],
         breadcrumb="Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
         attributes=["cotton", "short sleeve", "regular fit", "machine wash", "classic fit", "crew neck"],
         options={"color": _COLORS, "size": _CLOTHING_SIZES}, price=(8, 35)),
    dict(category="fashion", query="women's leggings", phrase="Women's Leggings", nouns=["women", "leggings"],
         breadcrumb="Clothing, Shoes & Jewelry › Women › Clothing › Active › Leggings",
         attributes=["high waist", "tummy control", "butt lifting", "quick drying", "moisture wicking",
                     "polyester spandex"],
         options={"color": _COLORS[:12], "size": _CLOTHING_SIZES}, price=(12, 45)),
    dict(category="fashion", query="men's jeans", phrase="Men's Jeans", nouns=["men", "jeans"],
         breadcrumb="Clothing, Shoes & Jewelry › Men › Clothing › Jeans",
         attributes=["slim fit", "button closure", "stretch fabric", "machine wash", "straight leg",
                     "zipper closure"],
         options={"color": ["light blue", "navy blue", "black", "gray", "khaki"],
                  "size": ["30w x 30l", "32w x 30l", "32w x 32l", "34w x 32l", "36w x 32l"]}, price=(20, 80)),
    dict(category="fashion", query="polarized sunglasses", phrase="Polarized Sunglasses", nouns=["sunglasses"],
         breadcrumb="Clothing, Shoes & Jewelry › Men › Accessories › Sunglasses & Eyewear Accessories › Sunglasses",
         attributes=["polarized", "uv protection", "lightweight", "unisex", "metal frame", "scratch resistant"],
         options={"color": ["black", "gold", "silver", "brown", "green", "light blue"]}, price=(9, 70)),
    # food
    dict(category="food", query="ground coffee", phrase="Ground Coffee", nouns=["coffee"],
         breadcrumb="Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
         attributes=["dark roast", "fair trade", "usda organic", "gluten free", "kosher certified", "non gmo"],
         options={"flavor name": ["original", "hazelnut", "french vanilla", "mocha", "caramel"],
                  "size": ["12 ounce", "24 ounce", "2 pound"]}, price=(7, 35)),
    dict(category="food", query="protein bars", phrase="Protein Bars", nouns=["protein", "bars"],
         breadcrumb="Grocery & Gourmet Food › Snack Foods › Bars › Protein Bars",
         attributes=["high protein", "low sugar", "gluten free", "keto friendly", "non gmo", "individually wrapped"],
         options={"flavor name": ["chocolate chip", "peanut butter", "cookies and cream", "birthday cake",
                                  "salted caramel"],
                  "size": ["12 count", "15 count", "24 count"]}, price=(12, 45)),
    dict(category="food", query="herbal tea", phrase="Herbal Tea", nouns=["tea"],
         breadcrumb="Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Tea › Herbal",
         attributes=["caffeine free", "usda organic", "non gmo", "natural ingredients", "sugar free", "gluten free"],
         options={"flavor name": ["chamomile", "peppermint", "ginger", "hibiscus", "lemon balm"],
                  "size": ["20 count", "40 count", "100 count"]}, price=(4, 25)),
    dict(category="food", query="beef jerky", phrase="Beef Jerky", nouns=["beef", "jerky"],
         breadcrumb="Grocery & Gourmet Food › Meat & Seafood › Jerky & Dried Meats › Beef Jerky",
         attributes=["high protein", "low fat", "ready to eat", "gluten free", "low carb", "individually wrapped"],
         options={"flavor name": ["original", "teriyaki", "peppered", "sweet and spicy", "smoked"],
                  "size": ["3.25 ounce", "10 ounce", "16 ounce"]}, price=(8, 40)),
    dict(category="food", query="dark chocolate", phrase="Dark Chocolate", nouns=["chocolate"],
         breadcrumb="Grocery & Gourmet Food › Candy & Chocolate › Chocolate › Chocolate Bars",
         attributes=["sugar free", "dairy free", "gift box", "low carb", "keto friendly", "non gmo"],
         options={"flavor name": ["sea salt", "almond", "orange", "mint", "raspberry"],
                  "size": ["3 pack", "6 pack", "12 pack"]}, price=(6, 40)),
    dict(category="food", query="extra virgin olive oil", phrase="Extra Virgin Olive Oil", nouns=["olive", "oil"],
         breadcrumb="Grocery & Gourmet Food › Pantry Staples › Cooking & Baking › Oils › Olive Oil",
         attributes=["cold pressed", "usda organic", "non gmo", "kosher certified", "bpa free", "gluten free"],
         options={"size": ["16.9 fl oz", "25.3 fl oz", "33.8 fl oz", "1 gallon"]}, price=(9, 55)),
    # furniture
    dict(category="furniture", query="office chair", phrase="Office Chair", nouns=["office", "chair"],
         breadcrumb="Home & Kitchen › Furniture › Home Office Furniture › Home Office Chairs › Desk Chairs",
         attributes=["ergonomic design", "lumbar support", "height adjustable", "easy assemble", "pu leather",
                     "heavy duty"],
         options={"color": ["black", "white", "gray", "brown", "navy blue", "pink"]}, price=(45, 260)),
    dict(category="furniture", query="coffee table", phrase="Coffee Table", nouns=["coffee", "table"],
         breadcrumb="Home & Kitchen › Furniture › Living Room Furniture › Tables › Coffee Tables",
         attributes=["easy assemble", "solid wood", "storage space", "living room", "mid century", "metal legs"],
         options={"color": ["walnut", "black", "white", "gray", "brown", "oak"]}, price=(40, 240)),
    dict(category="furniture", query="bookshelf", phrase="Bookshelf", nouns=["bookshelf"],
         breadcrumb="Home & Kitchen › Furniture › Home Office Furniture › Bookcases",
         attributes=["easy assemble", "engineered wood", "storage space", "living room", "heavy duty",
                     "space saving"],
         options={"color": ["walnut", "black", "white", "gray", "oak"], "size": ["3 tier", "4 tier", "5 tier"]},
         price=(35, 180)),
    dict(category="furniture", query="bed sheet set", phrase="Bed Sheet Set", nouns=["bed", "sheet", "set"],
         breadcrumb="Home & Kitchen › Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
         attributes=["machine washable", "deep pocket", "easy care", "wrinkle free", "breathable", "soft microfiber"],
         options={"color": _COLORS[:14], "size": ["twin", "full", "queen", "king", "california king"]},
         price=(18, 90)),
    dict(category="furniture", query="throw pillow covers", phrase="Throw Pillow Covers",
         nouns=["pillow", "covers"],
         breadcrumb="Home & Kitchen › Home Décor Products › Home Décor Accents › Decorative Pillows & Covers",
         attributes=["double sided", "living room", "hidden zipper", "machine washable", "super soft",
                     "farmhouse style"],
         options={"color": _COLORS[:14], "size": ["16x16 inch", "18x18 inch", "20x20 inch"]}, price=(8, 35)),
    dict(category="furniture", query="table lamp", phrase="Table Lamp", nouns=["table", "lamp"],
         breadcrumb="Home & Kitchen › Furniture › Living Room Furniture › Lamps & Shades › Table Lamps",
         attributes=["living room", "usb port", "touch control", "dimmable", "energy efficient", "bedside table"],
         options={"color": ["black", "white", "gold", "silver", "beige", "gray"]}, price=(15, 110)),
]  # fmt: skip
CATEGORIES = sorted({t["category"] for t in _TYPES})

_SYLLABLES = ["zo", "ve", "ra", "lu", "mi", "qa", "ta", "ni", "ko", "sa", "be", "li", "do", "fe", "ru", "xi", "po", "ma"]
_ENDINGS = ["", "x", "n", "ra", "lo", "va", "tek", "ly", "co"]
_INSTRUCTION_OPENERS = [
    "i need", "i am looking for", "i want", "find me", "i'm looking for", "get me", "i would like",
]  # fmt: skip
_FEATURE_SENTENCES = [
    "Backed by a 30-day satisfaction guarantee.",
    "Designed and tested by our own team.",
    "Makes a thoughtful gift for family and friends.",
    "Ships in recyclable packaging.",
    "Trusted by thousands of happy customers.",
]


def default_cache_dir() -> Path:
    """`$BIPACE_CACHE/webshop`, or `~/.cache/bipace_trainer/webshop`."""
    root = os.environ.get("BIPACE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "bipace_trainer") / "webshop"


def _brands(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) + rng.choice(_ENDINGS)
        names.add(word.capitalize())
    return sorted(names)


def _asin(rng: random.Random, taken: set[str]) -> str:
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _price(rng: random.Random, low: float, high: float) -> float:
    return round(int(rng.uniform(low, high)) + rng.choice([0.49, 0.95, 0.99]), 2)


def _product(rng: random.Random, kind: dict[str, Any], brand: str, asin: str) -> dict[str, Any]:
    attributes = rng.sample(kind["attributes"], rng.randint(3, min(5, len(kind["attributes"]))))
    option_names = [name for name in kind["options"] if rng.random() < 0.8]
    options = {
        name: rng.sample(pool, rng.randint(2, min(4, len(pool))))
        for name, pool in kind["options"].items()
        if name in option_names
    }
    # Distinct values across dimensions: WebShop's text env keys a clicked option by its value.
    seen: set[str] = set()
    for name in option_names:
        options[name] = [value for value in options[name] if not (value in seen or seen.add(value))]
    options = {name: values for name, values in options.items() if values}

    low = _price(rng, *kind["price"])
    pricing = [low] if rng.random() < 0.75 else [low, round(low * rng.uniform(1.15, 1.6), 2)]
    # WebShop draws the price of a product listed as a range uniformly inside it.
    price = pricing[0] if len(pricing) == 1 else round(rng.uniform(*pricing), 2)
    price_tag = f"${pricing[0]:.2f}" if len(pricing) == 1 else f"${pricing[0]:.2f} to ${pricing[1]:.2f}"

    in_title = [a for a in attributes if rng.random() < 0.35][:2]
    title = " ".join([brand, *(a.title() for a in in_title), kind["phrase"]])
    if options:
        name, values = next(iter(options.items()))
        title += f", {len(values)} {name.replace(' name', '')}s available" if rng.random() < 0.3 else ""
    described = rng.sample(attributes, max(1, len(attributes) - 1))
    description = (
        f"The {brand} {kind['phrase'].lower()} is {', '.join(described[:-1])}{' and ' if len(described) > 1 else ''}"
        f"{described[-1]}. {rng.choice(_FEATURE_SENTENCES)}"
    )
    bullets = [f"{a.upper()} - {rng.choice(_FEATURE_SENTENCES)}" for a in rng.sample(attributes, len(attributes))]
    bullets.append(rng.choice(_FEATURE_SENTENCES))
    return {
        "asin": asin,
        "category": kind["category"],
        "query": kind["query"],
        "product_category": kind["breadcrumb"],
        "Title": title,
        "title_nouns": [brand.lower(), *kind["nouns"]],
        "Description": description,
        "BulletPoints": bullets,
        "Attributes": attributes,
        "options": options,
        "pricing": pricing,
        "Price": price_tag,
        "price": price,
    }


def _goals(rng: random.Random, product: dict[str, Any], kind: dict[str, Any]) -> list[dict[str, Any]]:
    """WebShop's synthetic goals of one product: one per combination of its option values."""
    # An attribute the query already says ("polarized" sunglasses) would read twice.
    pool = [a for a in product["Attributes"] if a not in kind["query"]] or product["Attributes"]
    instruction_attributes = rng.sample(pool, rng.randint(1, min(3, len(pool))))
    article = "" if kind["phrase"].endswith("s") or rng.random() < 0.3 else "a "
    instruction = f"{rng.choice(_INSTRUCTION_OPENERS)} {article}{' and '.join(instruction_attributes)} {kind['query']}"
    above = [p for p in PRICE_STEPS if p > product["price"]][:4]
    if len(above) >= 2:
        price_upper = sorted(rng.sample(above, 2))[1]
        price_text = f", and price lower than {price_upper:.2f} dollars"
    else:
        price_upper, price_text = 1_000_000.0, ""
    names = sorted(product["options"])
    goals = []
    for combination in itertools.product(*(product["options"][name] for name in names)):
        goal_options = dict(zip(names, combination))
        option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
        goals.append(
            {
                "asin": product["asin"],
                "category": product["category"],
                "query": product["query"],
                "name": product["Title"],
                "name_nouns": product["title_nouns"],
                "product_category": product["product_category"],
                "instruction_text": f"{instruction}{' with ' + option_text if option_text else ''}{price_text}",
                "attributes": instruction_attributes,
                "price_upper": price_upper,
                "goal_options": goal_options,
            }
        )
    return goals


def generate_catalog(*, seed: int = 0, num_products: int = 1000) -> dict[str, Any]:
    """Products and goals, a deterministic function of (GENERATOR_VERSION, seed, num_products).

    Product types are dealt round-robin, so every type has num_products / 30 products
    (rounded): a search for a type finds several of them, as WebShop's searches do.
    """
    if num_products < 1:
        raise ValueError(f"num_products={num_products}: generate at least one product.")
    rng = random.Random(f"webshop:{GENERATOR_VERSION}:{seed}")
    brands = _brands(rng, max(60, num_products // 10))
    taken: set[str] = set()
    products, goals = [], []
    for index in range(num_products):
        kind = _TYPES[index % len(_TYPES)]
        product_rng = random.Random(f"webshop:{GENERATOR_VERSION}:{seed}:product:{index}")
        product = _product(product_rng, kind, product_rng.choice(brands), _asin(rng, taken))
        products.append(product)
        goals.extend(_goals(product_rng, product, kind))
    order = list(range(len(products)))
    rng.shuffle(order)  # WebShop's product file is shuffled too: neighbouring products differ in type
    random.Random(f"webshop:{GENERATOR_VERSION}:{seed}:goals").shuffle(goals)
    return {
        "generator": {"version": GENERATOR_VERSION, "seed": seed, "num_products": num_products},
        "products": [products[i] for i in order],
        "goals": goals,
    }


def load_catalog(*, seed: int = 0, num_products: int = 1000, cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The catalogue for these settings, generated on first use and cached as one JSON file.

    The file is written to a temporary name and renamed into place under a lock, so
    processes that start together generate it once and never read a partial file.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"v{GENERATOR_VERSION}-seed{seed}-products{num_products}.json"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f".{path.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.is_file():
                catalog = generate_catalog(seed=seed, num_products=num_products)
                with tempfile.NamedTemporaryFile("w", dir=cache, prefix=f".{path.stem}.", delete=False) as tmp:
                    json.dump(catalog, tmp)
                os.chmod(tmp.name, 0o644)  # a shared cache: readable by every user, as a plain write would be
                os.replace(tmp.name, path)
                return catalog
    return json.loads(path.read_text())
