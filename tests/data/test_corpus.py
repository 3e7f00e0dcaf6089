"""The built-in corpus: deterministic, deduplicated, HTML and gzip read as text, and no benchmark in it."""

import gzip
import json
from importlib import resources

from specdec.data.corpus import (
    BENCHMARK_PATH,
    MIN_CHUNK_CHARS,
    BenchmarkGuard,
    CorpusSource,
    build_corpus,
    default_sources,
)

BENCH = [json.loads(line)["prompt"] for line in
         (resources.files("specdec") / "prompts" / "bench.jsonl").read_text().splitlines() if line.strip()]


def module(i: int) -> str:
    return "".join(f"def helper_{i}_{j}(value):\n    return value * {j} + {i}\n\n\n" for j in range(30))


def fake_sources(root):
    """A code tree and a doc tree holding one of everything the builder must keep or leave out."""
    code, docs = root / "lib", root / "doc"
    (code / "pkg").mkdir(parents=True)
    (code / "human_eval").mkdir()
    (docs / "tool").mkdir(parents=True)
    for i in range(6):
        (code / "pkg" / f"mod{i}.py").write_text(module(i))
    (code / "pkg" / "copy_of_mod0.py").write_text(module(0))  # a duplicate
    (code / "human_eval" / "problems.py").write_text(module(100))  # a benchmark, by its path
    leaked = "# helpers\n" + BENCH[1].replace("    ", "\t") + module(101)  # a benchmark prompt, re-indented
    (code / "pkg" / "leaked.py").write_text(leaked)
    (code / "pkg" / "data.json").write_text(json.dumps({"not": "python"}) * 50)
    news = "".join(f"Version 1.{i}: fixed the frobnicator's handling of widgets in mode {i}.\n" for i in range(40))
    (docs / "tool" / "NEWS.gz").write_bytes(gzip.compress(news.encode()))
    paragraphs = "".join(f"<p>Paragraph {i} of the <b>manual</b> explains option number {i} at length.</p>" for i in range(30))
    (docs / "tool" / "manual.html").write_text(f"<html><script>var hidden = 1;</script><body>{paragraphs}</body></html>")
    (docs / "tool" / "copyright").write_text("Licensed under the terms of the licence. " * 40)
    return [CorpusSource("lib", "code", code), CorpusSource("doc", "prose", docs)]


def test_builder_keeps_text_and_leaves_out_benchmarks_and_duplicates(tmp_path):
    corpus = build_corpus(fake_sources(tmp_path), max_bytes=1 << 20, seed=0, chunk_chars=512)
    files = {row["source"].split(":", 2)[2].split("#")[0] for row in corpus.rows}
    assert files == {f"pkg/mod{i}.py" for i in range(6)} | {"pkg/leaked.py", "tool/NEWS.gz", "tool/manual.html"}
    assert corpus.excluded["benchmark_path"] == 1
    assert corpus.excluded["benchmark_text"] >= 1 and corpus.excluded["duplicate"] >= 1
    texts = [row["text"] for row in corpus.rows]
    assert len(set(texts)) == len(texts) and all(len(t.strip()) >= MIN_CHUNK_CHARS for t in texts)
    assert not any(BenchmarkGuard(BENCH).contaminated(t) for t in texts)
    assert not any("helper_100_" in t for t in texts)
    html = " ".join(r["text"] for r in corpus.rows if "manual.html" in r["source"])
    assert "Paragraph 3 of the manual explains" in html and "<p>" not in html and "hidden" not in html
    assert any("fixed the frobnicator" in r["text"] for r in corpus.rows if "NEWS.gz" in r["source"])
    assert [s["name"] for s in corpus.sources] == ["lib", "doc"] and corpus.sources[1]["files"] == 2


def test_builder_is_deterministic_and_seeded(tmp_path):
    sources = fake_sources(tmp_path)
    first = build_corpus(sources, seed=1, chunk_chars=512)
    assert build_corpus(sources, seed=1, chunk_chars=512).rows == first.rows
    other = build_corpus(sources, seed=2, chunk_chars=512)
    assert other.rows != first.rows
    assert sorted(r["text"] for r in other.rows) == sorted(r["text"] for r in first.rows)  # the same text, reordered


def test_size_limit_is_shared_between_sources(tmp_path):
    corpus = build_corpus(fake_sources(tmp_path), max_bytes=4000, chunk_chars=512)
    code, docs = corpus.sources
    assert code["files"] == 2 and docs["files"] == 1  # each reads until its 2000 characters are filled
    assert code["chars"] < 2000 + len(module(0)) + 200


def test_benchmark_guard():
    guard = BenchmarkGuard(BENCH)
    prose = next(p for p in BENCH if not p.lstrip().startswith(("def", "from", "//", "--")))
    words = prose.split()
    assert guard.contaminated("Some preface.\n" + "\n".join(words[5:18]) + "\nMore.")  # 13 words, re-wrapped
    assert not guard.contaminated(" ".join(words[5:17]))  # 12 words: chance overlap
    assert not guard.contaminated(module(0))
    for path in ("HumanEval.jsonl", "data/mbpp/test.py", "mt_bench/question.jsonl", "mt-bench", "gsm8k_train.txt"):
        assert BENCHMARK_PATH.search(path), path
    assert not BENCHMARK_PATH.search("rust/html/test/bench/fn.fmt_bench_samples.html")


def test_default_sources_build_deterministically():
    sources = default_sources()
    assert {s.name for s in sources} >= {"stdlib", "site-packages"}
    first = build_corpus(sources, max_bytes=300_000, seed=0)
    assert first.rows == build_corpus(sources, max_bytes=300_000, seed=0).rows
    assert all(s["chunks"] > 0 for s in first.sources)
    assert {r["source"].split(":")[1] for r in first.rows} == {s.name for s in sources}
