"""BM25 search over the catalogue, a faithful replica of the Lucene set-up WebShop used.

Upstream served search from a Lucene index (through Pyserini) with BM25 (k1 0.9, b 0.4) and
Lucene's English analyzer: the Unicode word-break tokenizer (UAX #29, ``StandardTokenizer``),
the English possessive filter, lower-casing, the 33 English stop words and the Porter stemmer.
Queries are bags of words: every distinct analysed term is one clause, weighted by how often it
occurs in the query. Hits are sorted by score, ties broken by ASIN.

Two Lucene details decide rankings and are replicated here:

* document lengths are stored as one-byte norms (``SmallFloat.intToByte4``): exact up to 39
  terms, then with a 4-bit mantissa, and BM25 uses the *decoded* length;
* scores are computed in 32-bit floats, clause scores summed in 64 bits then rounded to 32.

``scripts/webshop_search_agreement.py`` compares this module with real Lucene 8.7, term by term
and hit by hit.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import regex

from qevolve.environments.webshop.porter import porter_stem

# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET (33 words).
ENGLISH_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then "
    "there these they this to was will with".split()
)

BM25_K1 = 0.9
BM25_B = 0.4
MAX_TOKEN_LENGTH = 255  # StandardTokenizer splits longer tokens

# ---------------------------------------------------------------------------------------------
# Tokenizer: the word rules of UAX #29 as Lucene's StandardTokenizer applies them. Format and
# Extend characters (combining marks, soft hyphens, joiners) are transparent inside a token (WB4).

_FE = r"[\p{WB=Format}\p{WB=Extend}\p{WB=ZWJ}]*"
_LETTER = rf"[\p{{WB=ALetter}}\p{{WB=Hebrew_Letter}}]{_FE}"
_DIGIT = rf"\p{{WB=Numeric}}{_FE}"
_MID_LETTER = rf"[\p{{WB=MidLetter}}\p{{WB=MidNumLet}}\p{{WB=Single_Quote}}]{_FE}"
_MID_NUM = rf"[\p{{WB=MidNum}}\p{{WB=MidNumLet}}\p{{WB=Single_Quote}}]{_FE}"
_CONNECTOR = rf"\p{{WB=ExtendNumLet}}{_FE}"
_KATAKANA = rf"\p{{WB=Katakana}}{_FE}"
# A run of letters (joined directly, by connectors, or by mid-letter punctuation between
# letters), digits (by mid-number punctuation between digits), or katakana; runs of letters and
# digits chain directly (WB9, WB10), connectors chain anything (WB13a/b).
_LETTERS_OR_DIGITS = (rf"(?:{_DIGIT}(?:(?:{_CONNECTOR})*{_DIGIT}|{_MID_NUM}{_DIGIT})*"
                      rf"|{_LETTER}(?:(?:{_CONNECTOR})*{_LETTER}|{_MID_LETTER}{_LETTER})*)+")
_GROUP = rf"(?:{_KATAKANA}(?:(?:{_CONNECTOR})*{_KATAKANA})*|{_LETTERS_OR_DIGITS})"
_WORD = rf"(?:{_CONNECTOR})*{_GROUP}(?:(?:{_CONNECTOR})+{_GROUP})*(?:{_CONNECTOR})*"
_IDEOGRAPH = rf"[\p{{Script=Han}}\p{{Script=Hiragana}}]{_FE}"  # one token per character
_SOUTH_EAST_ASIAN = rf"(?:\p{{Line_Break=Complex_Context}}{_FE})+"
# Pictographs Lucene 8.7 emits as <EMOJI> tokens: Unicode 11's Extended_Pictographic (wider than
# today's: it also covers e.g. U+2605 BLACK STAR and reserved code points), measured against
# Lucene itself (scripts/webshop_search_agreement.py).
_EMOJI_RANGES = (
    "\u00a9\u00ae\u203c\u2049\u2122\u2139\u2194-\u2199\u21a9-\u21aa\u231a-\u231b\u2328\u2388\u23cf"
    "\u23e9-\u23f3\u23f8-\u23fa\u24c2\u25aa-\u25ab\u25b6\u25c0\u25fb-\u25fe\u2600-\u2605\u2607-\u2612"
    "\u2614-\u2685\u2690-\u2705\u2708-\u2712\u2714\u2716\u271d\u2721\u2728\u2733-\u2734\u2744\u2747"
    "\u274c\u274e\u2753-\u2755\u2757\u2763-\u2767\u2795-\u2797\u27a1\u27b0\u27bf\u2934-\u2935"
    "\u2b05-\u2b07\u2b1b-\u2b1c\u2b50\u2b55\u3030\u303d\u3297\u3299"
    "\U0001f000-\U0001f0ff\U0001f10d-\U0001f10f\U0001f12f\U0001f16c-\U0001f171\U0001f17e-\U0001f17f"
    "\U0001f18e\U0001f191-\U0001f19a\U0001f1ad-\U0001f1e5\U0001f201-\U0001f20f\U0001f21a\U0001f22f"
    "\U0001f232-\U0001f23a\U0001f23c-\U0001f23f\U0001f249-\U0001f53d"
    "\U0001f546-\U0001f64f\U0001f680-\U0001f6ff\U0001f774-\U0001f77f\U0001f7d5-\U0001f7ff"
    "\U0001f80c-\U0001f80f\U0001f848-\U0001f84f\U0001f85a-\U0001f85f\U0001f888-\U0001f88f"
    "\U0001f8ae-\U0001f8ff\U0001f90c-\U0001f93a\U0001f93c-\U0001f945\U0001f947-\U0001fffd"
)
_EMOJI_CHAR = f"[{_EMOJI_RANGES}]"
_FE_NO_JOINER = r"[\p{WB=Format}\p{WB=Extend}]*"
_EMOJI = (rf"{_EMOJI_CHAR}{_FE_NO_JOINER}(?:\u200d{_EMOJI_CHAR}{_FE_NO_JOINER})*\u200d?"
          rf"|\p{{Regional_Indicator}}{{2}}")
_TOKEN_RE = regex.compile(rf"{_WORD}|{_IDEOGRAPH}|{_SOUTH_EAST_ASIAN}|{_EMOJI}")
# The same rules restricted to ASCII (most of the text), with the faster ``re`` engine. A match of
# underscores alone is no token (the rules above need a letter or digit).
_ASCII_TOKEN_RE = re.compile(r"[A-Za-z0-9_]+(?:(?:(?<=[A-Za-z])[:.'](?=[A-Za-z])|(?<=[0-9])[,;.'](?=[0-9]))[A-Za-z0-9_]+)*")
# Whitespace always separates tokens, so text splits into ASCII stretches and non-ASCII chunks.
_NON_ASCII_CHUNK_RE = re.compile(r"(\S*[^\x00-\x7f]\S*)")
_POSSESSIVE_ENDINGS = ("'s", "'S", "\u2019s", "\u2019S", "\uff07s", "\uff07S")


def _split_long(tokens: list[str]) -> list[str]:
    if all(len(t) <= MAX_TOKEN_LENGTH for t in tokens):
        return tokens
    return [t[i:i + MAX_TOKEN_LENGTH] for t in tokens for i in range(0, len(t), MAX_TOKEN_LENGTH)]


def tokenize(text: str) -> list[str]:
    """The tokens of ``text`` as Lucene's StandardTokenizer cuts them (not yet lower-cased)."""
    if text.isascii():
        tokens = [t for t in _ASCII_TOKEN_RE.findall(text) if t.strip("_")]
        return _split_long(tokens)
    tokens = []
    for i, piece in enumerate(_NON_ASCII_CHUNK_RE.split(text)):
        if i % 2 == 0:
            tokens.extend(t for t in _ASCII_TOKEN_RE.findall(piece) if t.strip("_"))
        else:
            tokens.extend(_TOKEN_RE.findall(piece))
    return _split_long(tokens)


def _lower(token: str) -> str:
    """Per-character lower-casing, as Java's Character.toLowerCase (never changes the length)."""
    lowered = token.lower()
    if len(lowered) == len(token):
        return lowered
    return "".join(ch.lower() if len(ch.lower()) == 1 else ch for ch in token)


_TERM_CACHE: dict[str, str | None] = {}  # token -> analysed term (None: a stop word)


def _term(token: str) -> str | None:
    if token.endswith(_POSSESSIVE_ENDINGS):
        token = token[:-2]
    token = _lower(token)
    return None if token in ENGLISH_STOP_WORDS else porter_stem(token)


def analyze(text: str) -> list[str]:
    """Lucene's English analysis: tokens, minus possessives, lower-cased, stop words out, stemmed."""
    terms = []
    cache = _TERM_CACHE
    for token in tokenize(text):
        term = cache.get(token, "")
        if term == "":
            term = cache[token] = _term(token)
        if term is not None:
            terms.append(term)
    return terms


# ---------------------------------------------------------------------------------------------
# One-byte length norms (Lucene's SmallFloat.intToByte4 / byte4ToInt).

_NORM_FREE_VALUES = 24  # lengths below this are stored exactly


def _long_to_int4(value: int) -> int:
    """A 4-bit-mantissa float: 3 explicit mantissa bits, the rest the shift (+1, 0 = subnormal)."""
    bits = value.bit_length()
    if bits < 4:
        return value
    shift = bits - 4
    return ((value >> shift) & 0x07) | ((shift + 1) << 3)


def _int4_to_long(code: int) -> int:
    mantissa, shift = code & 0x07, (code >> 3) - 1
    return mantissa if shift == -1 else (mantissa | 0x08) << shift


def encode_length(length: int) -> int:
    if length < _NORM_FREE_VALUES:
        return length
    return _NORM_FREE_VALUES + _long_to_int4(length - _NORM_FREE_VALUES)


def decode_length(code: int) -> int:
    if code < _NORM_FREE_VALUES:
        return code
    return _NORM_FREE_VALUES + _int4_to_long(code - _NORM_FREE_VALUES)


# ---------------------------------------------------------------------------------------------


@dataclass
class SearchHit:
    doc_id: str
    score: float


class BM25Index:
    """An inverted index over ``documents`` (id -> text) with Lucene's BM25 scoring."""

    def __init__(self, documents: dict[str, str], k1: float = BM25_K1, b: float = BM25_B):
        started = time.perf_counter()
        self.doc_ids = list(documents)
        n_docs = len(self.doc_ids)
        # Ties are broken by id: rank of every document in id order.
        self._id_rank = np.empty(n_docs, dtype=np.int64)
        self._id_rank[np.argsort(np.array(self.doc_ids, dtype=object), kind="stable")] = np.arange(n_docs)
        postings: dict[str, tuple[list[int], list[int]]] = {}
        lengths = np.zeros(n_docs, dtype=np.int64)
        for index, doc_id in enumerate(self.doc_ids):
            terms = analyze(documents[doc_id])
            lengths[index] = len(terms)
            for term, freq in Counter(terms).items():
                docs, freqs = postings.setdefault(term, ([], []))
                docs.append(index)
                freqs.append(freq)
        self._postings = {term: (np.array(d, dtype=np.int64), np.array(f, dtype=np.float32))
                          for term, (d, f) in postings.items()}
        self.num_docs = n_docs
        docs_with_terms = int((lengths > 0).sum())
        self._doc_count = docs_with_terms
        f32 = np.float32
        avgdl = f32(lengths.sum() / docs_with_terms) if docs_with_terms else f32(1.0)
        # cache[norm] = 1 / (k1 * ((1 - b) + b * decoded_length / avgdl)), all in float32.
        decoded = np.array([decode_length(encode_length(int(n))) for n in lengths], dtype=np.float32)
        k1_, b_ = f32(k1), f32(b)
        self._norm_inverse = (f32(1.0) / (k1_ * ((f32(1.0) - b_) + b_ * decoded / avgdl))).astype(np.float32)
        self.build_seconds = time.perf_counter() - started

    def _idf(self, doc_freq: int) -> np.float32:
        return np.float32(math.log(1 + (self._doc_count - doc_freq + 0.5) / (doc_freq + 0.5)))

    def scores(self, query: str) -> np.ndarray:
        """float32 scores of every document (0 where no term matches) and a hit mask."""
        totals = np.zeros(self.num_docs, dtype=np.float64)
        matched = np.zeros(self.num_docs, dtype=bool)
        for term, count in Counter(analyze(query)).items():
            posting = self._postings.get(term)
            if posting is None:
                continue
            docs, freqs = posting
            weight = np.float32(count) * self._idf(len(docs))
            term_scores = weight - weight / (np.float32(1.0) + freqs * self._norm_inverse[docs])
            totals[docs] += term_scores.astype(np.float64)
            matched[docs] = True
        scores = totals.astype(np.float32)
        scores[~matched] = -np.inf
        return scores

    def search(self, query: str, top_k: int = 50) -> list[SearchHit]:
        """The ``top_k`` best documents (those sharing at least one term with the query)."""
        scores = self.scores(query)
        hits = np.flatnonzero(np.isfinite(scores))
        if hits.size == 0:
            return []
        order = np.lexsort((self._id_rank[hits], -scores[hits].astype(np.float64)))[:top_k]
        return [SearchHit(self.doc_ids[i], float(scores[i])) for i in hits[order]]
