#!/usr/bin/env python
"""How closely does WebShop search here agree with real Lucene? Measures and prints it.

Builds the catalogue's documents exactly as the environment indexes them, then answers the same
queries three ways:

* ``lucene``: real Apache Lucene 8.7 (EnglishAnalyzer, BM25 k1 0.9 b 0.4, ties by id), through the
  small Java program beside this script. Needs a JDK and Debian's ``liblucene8-java``
  (``apt-get install liblucene8-java``); the reference it establishes is the one every other
  column is compared with.
* ``replica``: this project's search (``qevolve.environments.webshop.search``), the default.
* ``bm25s``: the ``bm25s`` library (method "lucene", k1 0.9, b 0.4, 1-letter tokens kept, the same
  stop words and Porter stemmer), for comparison.

Query sets: the 1,506 human instructions of ``goal_query_map.json``, their human search queries,
and the synthetic goal texts. Reports, per set, top-1 agreement with Lucene, agreement of the
top-10 lists (same ASINs in the same order), analyser agreement (identical term lists) and
per-query latency. Rerunnable; writes a JSON report with ``--output``.

    PYTHONPATH=src python scripts/webshop_search_agreement.py --output runs/webshop_search_agreement.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JAVA_SOURCE = HERE / "webshop_lucene_reference" / "LuceneReference.java"
LUCENE_JARS = ("lucene-core-8.7.0.jar", "lucene-analyzers-common-8.7.0.jar")
TOP_K = 50


def one_line(text: str) -> str:
    return " ".join(text.replace("\t", " ").splitlines()).replace("\u2028", " ").replace("\u2029", " ")


def run_lucene(docs: dict[str, str], queries: list[str], jar_dir: Path, work: Path):
    """Real Lucene: (doc term lists, query term lists, ranked ASIN lists, ms per query) or None."""
    jars = [jar_dir / name for name in LUCENE_JARS]
    if not shutil.which("javac") or not all(j.is_file() for j in jars):
        print(f"lucene reference skipped: needs javac and {', '.join(LUCENE_JARS)} in {jar_dir} "
              "(Debian: apt-get install liblucene8-java)", file=sys.stderr)
        return None
    classpath = ":".join(str(j) for j in jars)
    classes = work / "classes"
    classes.mkdir()
    subprocess.run(["javac", "-cp", classpath, "-d", str(classes), str(JAVA_SOURCE)], check=True)
    (work / "docs.tsv").write_text("".join(f"{asin}\t{one_line(text)}\n" for asin, text in docs.items()), encoding="utf-8")
    (work / "queries.txt").write_text("".join(one_line(q) + "\n" for q in queries), encoding="utf-8")
    out = work / "out"
    proc = subprocess.run(["java", "-cp", f"{classpath}:{classes}", "LuceneReference", str(work / "docs.tsv"),
                           str(work / "queries.txt"), str(out), str(TOP_K)], check=True, capture_output=True, text=True)
    ms_per_query = float(proc.stdout.split(",")[-1].split("ms")[0].strip())

    def terms(path: Path) -> list[list[str]]:
        return [line.split("\u0001") if line else [] for line in path.read_text(encoding="utf-8").split("\n")[:-1]]

    ranked = []
    for line in (out / "results.tsv").read_text(encoding="utf-8").splitlines():
        _, _, hits = line.partition("\t")
        ranked.append([hit.rsplit(":", 1)[0] for hit in hits.split()])
    return terms(out / "doc_tokens.txt"), terms(out / "query_tokens.txt"), ranked, ms_per_query


def run_bm25s(docs: dict[str, str], queries: list[str]):
    import bm25s

    from qevolve.environments.webshop.porter import porter_stem
    from qevolve.environments.webshop.search import ENGLISH_STOP_WORDS

    def tokens(texts):
        return bm25s.tokenize(texts, lower=True, token_pattern=r"(?u)\b\w+\b", stopwords=sorted(ENGLISH_STOP_WORDS),
                              stemmer=lambda words: [porter_stem(w) for w in words], return_ids=False,
                              show_progress=False)

    asins = list(docs)
    retriever = bm25s.BM25(method="lucene", k1=0.9, b=0.4)
    retriever.index(tokens(list(docs.values())), show_progress=False)
    query_tokens = tokens(queries)
    ranked, started = [], time.perf_counter()
    for q in query_tokens:
        q = [t for t in q if t in retriever.vocab_dict] if hasattr(retriever, "vocab_dict") else q
        if not q:
            ranked.append([])
            continue
        ids, scores = retriever.retrieve([q], k=TOP_K, show_progress=False)
        ranked.append([asins[i] for i, s in zip(ids[0], scores[0]) if s > 0])
    return ranked, (time.perf_counter() - started) * 1000 / max(1, len(queries))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", type=Path, default=None, help="WebShop data folder (default: installed)")
    parser.add_argument("--lucene-jars", type=Path, default=Path("/usr/share/java"), help="folder with the Lucene 8.7 jars")
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--no-bm25s", action="store_true", help="skip the bm25s comparison")
    args = parser.parse_args()

    from qevolve.environments.webshop.catalog import load_catalog
    from qevolve.environments.webshop.search import analyze

    catalog = load_catalog(args.data_root)
    root = catalog.source
    docs = {asin: p.search_text() for asin, p in catalog.products.items()}
    query_map = json.loads((root / "goal_query_map.json").read_text())
    query_sets = {
        "human instructions": sorted({one_line(k).lower() for k in query_map}),
        "human search queries": sorted({one_line(q).lower() for qs in query_map.values() for q in qs}),
        "synthetic goals": sorted({one_line(g.instruction).lower() for g in catalog.goals}),
    }
    all_queries = [q for qs in query_sets.values() for q in qs]

    index = catalog.search_index
    started = time.perf_counter()
    replica = [[hit.doc_id for hit in index.search(q, TOP_K)] for q in all_queries]
    replica_ms = (time.perf_counter() - started) * 1000 / len(all_queries)
    print(f"replica: index built in {index.build_seconds:.2f} s, {replica_ms:.3f} ms/query over {len(all_queries)} queries")

    bm25s_ranked, bm25s_ms = (None, None) if args.no_bm25s else run_bm25s(docs, all_queries)
    with tempfile.TemporaryDirectory() as tmp:
        lucene = run_lucene(docs, all_queries, args.lucene_jars, Path(tmp))

    report: dict = {"queries": {name: len(qs) for name, qs in query_sets.items()},
                    "latency_ms_per_query": {"replica": round(replica_ms, 4)}}
    if bm25s_ms is not None:
        report["latency_ms_per_query"]["bm25s"] = round(bm25s_ms, 4)
    if lucene is None:
        print(json.dumps(report, indent=1))
        return 0
    doc_terms, query_terms, lucene_ranked, lucene_ms = lucene
    report["latency_ms_per_query"]["lucene (JVM, warm)"] = lucene_ms
    ours_doc_terms = [analyze(t) for t in docs.values()]
    ours_query_terms = [analyze(q) for q in all_queries]
    report["analyzer_identical"] = {
        "documents": f"{sum(a == b for a, b in zip(ours_doc_terms, doc_terms))}/{len(docs)}",
        "queries": f"{sum(a == b for a, b in zip(ours_query_terms, query_terms))}/{len(all_queries)}",
    }
    mismatches = [(i, a, b) for i, (a, b) in enumerate(zip(ours_doc_terms, doc_terms)) if a != b][:3]
    for i, ours, ref in mismatches:
        diff = [(x, y) for x, y in zip(ours, ref) if x != y][:5]
        print(f"analyzer differs on doc {list(docs)[i]}: first differences (ours, lucene) {diff}; "
              f"lengths {len(ours)} vs {len(ref)}")
    rows = []
    offset = 0
    for name, qs in query_sets.items():
        reference = lucene_ranked[offset:offset + len(qs)]
        row = {"query set": name, "queries": len(qs)}
        for label, ranked in (("replica", replica), ("bm25s", bm25s_ranked)):
            if ranked is None:
                continue
            mine = ranked[offset:offset + len(qs)]
            top1 = sum((a[:1] == b[:1]) for a, b in zip(mine, reference))
            top10 = sum((a[:10] == b[:10]) for a, b in zip(mine, reference))
            row[f"{label} top-1"] = round(top1 / len(qs), 4)
            row[f"{label} top-10 list"] = round(top10 / len(qs), 4)
            row[f"{label} top-50 list"] = round(sum(a == b for a, b in zip(mine, reference)) / len(qs), 4)
        rows.append(row)
        offset += len(qs)
    report["agreement_with_lucene"] = rows
    print(json.dumps(report, indent=1))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
