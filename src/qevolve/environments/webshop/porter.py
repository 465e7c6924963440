"""The Porter stemmer, in the variant Lucene's ``PorterStemFilter`` applies.

That variant is Martin Porter's own reference implementation of the 1980 algorithm, which departs
from the paper in three places: ``bli -> ble`` replaces ``abli -> able`` and ``logi -> log`` is added
(step 2), and every step stops at the *longest* listed suffix that ends the word, even when its
measure condition then fails (no fall-back to a shorter suffix). Words of one or two letters are
left alone. Written from the published description of the algorithm; checked term for term
against Lucene 8.7 on the whole WebShop catalogue (``scripts/webshop_search_agreement.py``).
"""

from __future__ import annotations

import functools

_VOWELS = frozenset("aeiou")

# Step 2 and step 3 rules, grouped and ordered as in the reference implementation: within a group
# the first suffix that ends the word is the only one considered.
_STEP2 = [
    ("ational", "ate"), ("tional", "tion"),
    ("enci", "ence"), ("anci", "ance"),
    ("izer", "ize"),
    ("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous"),
    ("ization", "ize"), ("ation", "ate"), ("ator", "ate"),
    ("alism", "al"), ("iveness", "ive"), ("fulness", "ful"), ("ousness", "ous"),
    ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"),
    ("logi", "log"),
]
_STEP3 = [
    ("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"), ("ical", "ic"),
    ("ful", ""), ("ness", ""),
]
_STEP4 = ["al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent",
          "ion", "ou", "ism", "ate", "iti", "ous", "ive", "ize"]


def _group_by_penultimate(rules):
    """The reference dispatches on the second-to-last letter of the word; emulate its order."""
    groups: dict[str, list] = {}
    for rule in rules:
        suffix = rule[0] if isinstance(rule, tuple) else rule
        groups.setdefault(suffix[-2], []).append(rule)
    return groups


_STEP2_BY_CHAR = _group_by_penultimate(_STEP2)
_STEP3_BY_CHAR = {"e": [("icate", "ic"), ("ative", ""), ("alize", "al")], "i": [("iciti", "ic")],
                  "l": [("ical", "ic"), ("ful", "")], "s": [("ness", "")]}
# Step 3 in the reference dispatches on the *last* letter, unlike steps 2 and 4.
_STEP4_BY_CHAR = _group_by_penultimate(_STEP4)


def _is_consonant(word: str, i: int) -> bool:
    ch = word[i]
    if ch in _VOWELS:
        return False
    if ch == "y":
        return True if i == 0 else not _is_consonant(word, i - 1)
    return True


def _measure(stem: str) -> int:
    """m in [C](VC)^m[V]: the number of vowel-consonant sequences of ``stem``."""
    count = 0
    i, n = 0, len(stem)
    while i < n and _is_consonant(stem, i):
        i += 1
    while i < n:
        while i < n and not _is_consonant(stem, i):
            i += 1
        if i >= n:
            break
        count += 1
        while i < n and _is_consonant(stem, i):
            i += 1
    return count


def _has_vowel(stem: str) -> bool:
    return any(not _is_consonant(stem, i) for i in range(len(stem)))


def _ends_double_consonant(word: str) -> bool:
    return len(word) >= 2 and word[-1] == word[-2] and _is_consonant(word, len(word) - 1)


def _ends_cvc(word: str) -> bool:
    """consonant-vowel-consonant, the last consonant not w, x or y (e.g. -hop, -fil)."""
    i = len(word) - 1
    if i < 2 or not _is_consonant(word, i) or _is_consonant(word, i - 1) or not _is_consonant(word, i - 2):
        return False
    return word[i] not in "wxy"


def _step1ab(word: str) -> str:
    if word.endswith("s"):
        if word.endswith("sses"):
            word = word[:-2]
        elif word.endswith("ies"):
            word = word[:-2]
        elif not word.endswith("ss"):
            word = word[:-1]
    if word.endswith("eed"):
        if _measure(word[:-3]) > 0:
            word = word[:-1]
        return word
    for suffix in ("ed", "ing"):
        if word.endswith(suffix) and _has_vowel(word[: -len(suffix)]):
            word = word[: -len(suffix)]
            if word.endswith(("at", "bl", "iz")):
                return word + "e"
            if _ends_double_consonant(word):
                return word if word[-1] in "lsz" else word[:-1]
            if _measure(word) == 1 and _ends_cvc(word):
                return word + "e"
            return word
    return word


def _step1c(word: str) -> str:
    if word.endswith("y") and _has_vowel(word[:-1]):
        return word[:-1] + "i"
    return word


def _replace_first(word: str, rules: list[tuple[str, str]], min_measure: int) -> str:
    for suffix, replacement in rules:
        if word.endswith(suffix):
            stem = word[: -len(suffix)]
            return stem + replacement if _measure(stem) > min_measure else word
    return word


def _step4(word: str) -> str:
    for suffix in _STEP4_BY_CHAR.get(word[-2] if len(word) >= 2 else "", []):
        if not word.endswith(suffix):
            continue
        stem = word[: -len(suffix)]
        if suffix == "ion" and not stem.endswith(("s", "t")):
            continue  # the reference then tries "ou" (same group), which cannot match "-ion"
        return stem if _measure(stem) > 1 else word
    return word


def _step5(word: str) -> str:
    if word.endswith("e"):
        m = _measure(word[:-1])
        if m > 1 or (m == 1 and not _ends_cvc(word[:-1])):
            word = word[:-1]
    if word.endswith("ll") and _measure(word) > 1:
        word = word[:-1]
    return word


@functools.lru_cache(maxsize=200_000)
def porter_stem(word: str) -> str:
    """Stem one lower-case token."""
    if len(word) <= 2:
        return word
    word = _step1ab(word)
    word = _step1c(word)
    if len(word) >= 2:
        word = _replace_first(word, _STEP2_BY_CHAR.get(word[-2], []), 0)
    if word:
        word = _replace_first(word, _STEP3_BY_CHAR.get(word[-1], []), 0)
    word = _step4(word)
    return _step5(word)
