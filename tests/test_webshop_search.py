"""WebShop search: the Lucene-replica analyser, norms and BM25, checked against values real Lucene 8.7 produced.

Every expected value below was printed by Apache Lucene 8.7 (EnglishAnalyzer, BM25Similarity(0.9, 0.4))
through scripts/webshop_lucene_reference/LuceneReference.java.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qevolve.data.install import dataset_dir
from qevolve.environments.webshop.catalog import load_catalog
from qevolve.environments.webshop.porter import porter_stem
from qevolve.environments.webshop.search import BM25Index, analyze, decode_length, encode_length, tokenize


@pytest.fixture(scope="module")
def data_root(webshop_installed) -> Path:
    return dataset_dir("webshop")


def test_analyzer_matches_lucene_on_word_break_cases():
    text = "men's x-large 3.5mm 1,000 a:b u.s.a. wi-fi don't O'Neil's _under_score__ 12_34 abc.123 ❤️ 👨‍💼 中文 ｶﾀｶﾅ"
    assert analyze(text) == ["men", "x", "larg", "3.5mm", "1,000", "a:b", "u.s.a", "wi", "fi", "don't", "o'neil",
                             "_under_score__", "12_34", "abc", "123", "❤️", "👨‍💼", "中", "文", "ｶﾀｶﾅ"]
    assert analyze("The a an") == []  # stop words only
    assert tokenize("x" * 300) == ["x" * 255, "x" * 45]


def test_porter_stems_match_lucene():
    words = ("caresses ponies relational generalization archaeology hopping filing happy conditional electrical "
             "sensibility ability agreed feed plastered motoring sing conflated troubled sized hopeful goodness "
             "formality").split()
    expected = ("caress poni relat gener archaeolog hop file happi condit electr sensibl abil agre feed plaster "
                "motor sing conflat troubl size hope good formal").split()
    assert [porter_stem(w) for w in words] == expected
    assert porter_stem("is") == "is"  # two letters: untouched


def test_length_norms_match_lucene_smallfloat():
    # length -> (byte, decoded length), from SmallFloat.intToByte4 / byte4ToInt
    cases = {0: (0, 0), 23: (23, 23), 24: (24, 24), 39: (39, 39), 40: (40, 40), 41: (40, 40), 47: (43, 46),
             48: (44, 48), 55: (47, 54), 100: (57, 96), 137: (62, 136), 1000: (87, 984), 5000: (105, 4632)}
    for length, (code, decoded) in cases.items():
        assert encode_length(length) == code
        assert decode_length(code) == decoded


def test_bm25_scores_and_ties_match_lucene():
    docs = {
        "D3": "red cotton t-shirt for men, size x-large",
        "D1": "blue cotton shirt",
        "D2": "blue cotton shirt",
        "D4": "men's running shoes with arch support; 3.5mm sole, 1,000 miles, wi-fi u.s.a. a:b relational "
              "generalization archaeology hopping filing happy conditional electrical",
        "D5": "the a an",
    }
    index = BM25Index(docs)
    hits = index.search("blue shirt")
    assert [h.doc_id for h in hits] == ["D1", "D2", "D3"]  # the D1/D2 tie is broken by id
    assert [h.score for h in hits] == pytest.approx([0.63111943, 0.63111943, 0.19082274], abs=1e-7)
    hits = index.search("cotton shirt cotton")  # a repeated query term counts twice
    assert [h.score for h in hits] == pytest.approx([0.64326465, 0.64326465, 0.5724682], abs=1e-7)
    assert [(h.doc_id, round(h.score, 6)) for h in index.search("running shoes")] == [("D4", 1.001641)]
    assert index.search("zzz unknown") == []
    assert len(index.search("cotton", top_k=1)) == 1


def test_catalogue_search_top_hits_match_lucene(data_root):
    index = load_catalog(data_root).search_index
    expected = {
        "easy spirit traveltime529 mule shoes arch support": ["B094RBNS2K", "B09S6VN97V", "B09QPX97VW"],
        "non alcoholic cocktail mixer 1 oz up to 60 dollars": ["B08WG7VLQF", "B0874Y2KJR", "B07KK49655"],
        "apple compatible case cover, clear green or silver glitter, less than $40": ["B07VVVDRCX", "B08MBG3421", "B098SV78BW"],
        "pink ottoman with solid wooden frame up to 360 dollars": ["B09QHT6WKQ", "B099WH1RTM", "B094YFJ95K"],
        "noise cancelling headphones": ["B092W6WNH4", "B09L86RDXS", "B09J8772MN"],
        "x-large men's t-shirt black": ["B09QQP3356", "B09RVF4JP1", "B09KLQLLT2"],
    }
    for query, top3 in expected.items():
        assert [h.doc_id for h in index.search(query)[:3]] == top3, query
    assert len(index.search("shirt")) == 50
