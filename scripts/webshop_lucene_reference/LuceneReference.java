// Reference search for the WebShop catalogue with real Apache Lucene (measurement tool only).
//
// Indexes one document per line of DOCS ("id<TAB>text") with Lucene's EnglishAnalyzer and
// BM25Similarity(k1=0.9, b=0.4), then answers every line of QUERIES as a bag-of-words query (each
// distinct analysed term once, boosted by its count in the query), top K, ties broken by id.
// Writes OUT/doc_tokens.txt and OUT/query_tokens.txt (the analysed terms, one line per input line,
// separated by U+0001) and OUT/results.tsv ("query index<TAB>id:score id:score ...").
//
// Build and run (Debian: apt-get install liblucene8-java default-jdk-headless):
//   scripts/webshop_search_agreement.py does it for you.
import java.io.*;
import java.nio.charset.StandardCharsets;
import java.nio.file.*;
import java.util.*;
import org.apache.lucene.analysis.Analyzer;
import org.apache.lucene.analysis.TokenStream;
import org.apache.lucene.analysis.en.EnglishAnalyzer;
import org.apache.lucene.analysis.tokenattributes.CharTermAttribute;
import org.apache.lucene.document.*;
import org.apache.lucene.index.*;
import org.apache.lucene.search.*;
import org.apache.lucene.search.similarities.BM25Similarity;
import org.apache.lucene.store.ByteBuffersDirectory;
import org.apache.lucene.util.BytesRef;

public class LuceneReference {
    static List<String> analyze(Analyzer analyzer, String text) throws IOException {
        List<String> terms = new ArrayList<>();
        try (TokenStream stream = analyzer.tokenStream("contents", text)) {
            CharTermAttribute term = stream.addAttribute(CharTermAttribute.class);
            stream.reset();
            while (stream.incrementToken()) terms.add(term.toString());
            stream.end();
        }
        return terms;
    }

    public static void main(String[] args) throws Exception {
        Path docsPath = Paths.get(args[0]), queriesPath = Paths.get(args[1]), out = Paths.get(args[2]);
        int k = Integer.parseInt(args[3]);
        Files.createDirectories(out);
        Analyzer analyzer = new EnglishAnalyzer();
        BM25Similarity similarity = new BM25Similarity(0.9f, 0.4f);
        ByteBuffersDirectory directory = new ByteBuffersDirectory();
        IndexWriterConfig config = new IndexWriterConfig(analyzer).setSimilarity(similarity);
        List<String> docLines = Files.readAllLines(docsPath, StandardCharsets.UTF_8);
        try (IndexWriter writer = new IndexWriter(directory, config);
             Writer tokens = Files.newBufferedWriter(out.resolve("doc_tokens.txt"), StandardCharsets.UTF_8)) {
            for (String line : docLines) {
                int tab = line.indexOf('\t');
                String id = line.substring(0, tab), text = line.substring(tab + 1);
                Document doc = new Document();
                doc.add(new StringField("id", id, Field.Store.YES));
                doc.add(new SortedDocValuesField("id", new BytesRef(id)));
                doc.add(new TextField("contents", text, Field.Store.NO));
                writer.addDocument(doc);
                tokens.write(String.join("\u0001", analyze(analyzer, text)) + "\n");
            }
        }
        IndexSearcher searcher = new IndexSearcher(DirectoryReader.open(directory));
        searcher.setSimilarity(similarity);
        Sort byScoreThenId = new Sort(SortField.FIELD_SCORE, new SortField("id", SortField.Type.STRING));
        List<String> queries = Files.readAllLines(queriesPath, StandardCharsets.UTF_8);
        long started = System.nanoTime();
        try (Writer results = Files.newBufferedWriter(out.resolve("results.tsv"), StandardCharsets.UTF_8);
             Writer tokens = Files.newBufferedWriter(out.resolve("query_tokens.txt"), StandardCharsets.UTF_8)) {
            for (int i = 0; i < queries.size(); i++) {
                List<String> terms = analyze(analyzer, queries.get(i));
                tokens.write(String.join("\u0001", terms) + "\n");
                Map<String, Integer> counts = new LinkedHashMap<>();
                for (String t : terms) counts.merge(t, 1, Integer::sum);
                BooleanQuery.Builder builder = new BooleanQuery.Builder();
                for (Map.Entry<String, Integer> e : counts.entrySet())
                    builder.add(new BoostQuery(new TermQuery(new Term("contents", e.getKey())), e.getValue()),
                                BooleanClause.Occur.SHOULD);
                StringBuilder row = new StringBuilder().append(i).append('\t');
                if (!counts.isEmpty()) {
                    TopDocs top = searcher.search(builder.build(), k, byScoreThenId, true);
                    for (ScoreDoc hit : top.scoreDocs) {
                        String id = searcher.doc(hit.doc).get("id");
                        row.append(id).append(':').append(hit.score).append(' ');
                    }
                }
                results.write(row.toString().trim() + "\n");
            }
        }
        System.out.printf("lucene %d docs, %d queries, %.3f ms/query%n", docLines.size(), queries.size(),
                          (System.nanoTime() - started) / 1e6 / Math.max(1, queries.size()));
    }
}
