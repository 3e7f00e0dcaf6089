"""The prompt corpus: deterministic, deduplicated, HTML and gzip read as text, no benchmark in it; added
directories of code and prose; `specdec corpus` writes it for `distill --prompts`."""

import gzip
import json
from importlib import resources

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.data.corpus import (
    BENCHMARK_PATH,
    MIN_CHUNK_CHARS,
    BenchmarkGuard,
    CorpusSource,
    build_corpus,
    default_sources,
    heldout_path,
    parse_source,
)
from specdec.data.sources import jsonl_rows
from specdec.errors import SpecdecError

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


def test_added_sources_take_code_and_prose_by_suffix(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "lib").mkdir(parents=True)
    js = "".join(f"export function handler{i}(req, res) {{\n  return res.status({i}).json({{ ok: true }});\n}}\n\n"
                 for i in range(20))
    (pkg / "lib" / "routes.js").write_text(js)
    (pkg / "lib" / "routes.min.js").write_text(js.replace("\n", ""))  # by its name
    (pkg / "lib" / "bundle.js").write_text(js.replace("\n", " ") + "\n")  # by its line lengths
    (pkg / "lib" / "types.d.ts").write_text("export declare const x: number;\n" * 40)
    (pkg / "README.md").write_text("This package routes requests to handlers, one per status code.\n" * 20)
    kinds = {}
    for kind in ("any", "code", "prose"):
        corpus = build_corpus([parse_source(f"{pkg}:{kind}" if kind != "any" else str(pkg))], chunk_chars=512)
        kinds[kind] = {r["source"].split(":", 2)[2].split("#")[0] for r in corpus.rows}
        assert corpus.excluded["minified"] == (kind != "prose")
    assert kinds == {"any": {"lib/routes.js", "README.md"}, "code": {"lib/routes.js"}, "prose": {"README.md"}}


def _files(rows):
    return {row["source"].rsplit("#", 1)[0] for row in rows}


def test_heldout_files_leave_the_rows_whole_and_span_the_sources(tmp_path):
    sources = fake_sources(tmp_path)
    whole = build_corpus(sources, max_bytes=1 << 20, seed=0, chunk_chars=512)
    split = build_corpus(sources, max_bytes=1 << 20, seed=0, chunk_chars=512, heldout=3)
    held = _files([{"source": p["source"]} for p in split.heldout])
    assert len(split.heldout) == len(held) == 3
    assert {f.split(":")[1] for f in held} == {"lib", "doc"}  # round robin over the sources
    assert held.isdisjoint(_files(split.rows)) and held | _files(split.rows) == _files(whole.rows)
    assert sorted(r["text"] for r in split.rows) == sorted(r["text"] for r in whole.rows if _files([r]).isdisjoint(held))
    chunks = {r["source"]: r["text"] for r in whole.rows}
    assert all(p["prompt"] == chunks[p["source"]] for p in split.heldout)
    assert split.heldout == build_corpus(sources, max_bytes=1 << 20, seed=0, chunk_chars=512, heldout=3).heldout
    assert split.describe()["heldout_files"] == 3
    assert split.excluded["held_out"] == len(whole.rows) - len(split.rows) > 3  # every chunk of those files
    with pytest.raises(SpecdecError, match="cannot hold out 99 files"):
        build_corpus(sources, max_bytes=1 << 20, heldout=99)


def test_parse_source(tmp_path):
    assert parse_source(str(tmp_path)) == CorpusSource(str(tmp_path), "any", tmp_path)
    assert parse_source(f"{tmp_path}:prose").kind == "prose" and parse_source(f"{tmp_path}:code").root == tmp_path
    with pytest.raises(SpecdecError, match="is not a directory"):
        parse_source(f"{tmp_path}/missing:code")


def test_cli_writes_a_corpus_that_distill_reads(tmp_path):
    sources = fake_sources(tmp_path)
    out = tmp_path / "corpus.jsonl"
    args = ["corpus", "--no-builtin", "--source", f"{sources[0].root}:code", "--source", f"{sources[1].root}:prose",
            "--mb", "1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    rows = list(jsonl_rows(out))
    assert rows == [(f"{out}:{n}", r) for n, r in enumerate(build_corpus(
        [parse_source(a) for a in args[3:6:2]], max_bytes=1 << 20).rows, 1)]
    manifest = json.loads((tmp_path / "corpus.manifest.json").read_text())
    assert manifest["rows"] == len(rows) and [s["kind"] for s in manifest["sources"]] == ["code", "prose"]
    assert f"wrote {len(rows):,} rows" in result.stderr

    again = CliRunner().invoke(app, args)
    assert again.exit_code == 1 and "already exists" in again.stderr
    for bad, needle in ((["--source", f"{tmp_path}/nowhere"], "is not a directory"),
                        ([], "no sources"), (["--source", str(tmp_path), "--mb", "0"], "--mb must be > 0")):
        result = CliRunner().invoke(app, ["corpus", "--no-builtin", *bad, "--out", str(tmp_path / "x.jsonl")])
        assert result.exit_code == 1 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()
    assert not heldout_path(out).exists()


def test_cli_holds_out_files_as_bench_prompts(tmp_path):
    sources = fake_sources(tmp_path)
    out = tmp_path / "corpus.jsonl"
    args = ["corpus", "--no-builtin", "--source", f"{sources[0].root}:code", "--source", f"{sources[1].root}:prose",
            "--mb", "1", "--out", str(out), "--heldout", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert heldout_path(out) == tmp_path / "corpus.heldout.jsonl" and "held out 2 files" in result.stderr
    built = build_corpus([parse_source(a) for a in args[3:6:2]], max_bytes=1 << 20, heldout=2)
    assert [row["prompt"] for _, row in jsonl_rows(heldout_path(out))] == [p["prompt"] for p in built.heldout]
    assert json.loads((tmp_path / "corpus.manifest.json").read_text())["heldout_files"] == 2
    assert _files([r for _, r in jsonl_rows(out)]).isdisjoint(_files(built.heldout))

    again = CliRunner().invoke(app, args[:-2] + ["--overwrite"])  # no held-out split now: none stale is left
    assert again.exit_code == 0 and not heldout_path(out).exists()
    bad = CliRunner().invoke(app, args[:-1] + ["-1", "--overwrite"])
    assert bad.exit_code == 1 and "heldout must be >= 0" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
