"""A prompt corpus from text already on the machine: nothing is downloaded.

Self-distillation needs prompts, not answers (the target writes those), so any text of the right kind will
do. The built-in sources, whatever of them exists here:
  stdlib          code   the Python standard library's source files (`sysconfig.get_paths()["stdlib"]`)
  site-packages   code   the source files of the installed packages (`sysconfig.get_paths()["purelib"]`)
  debian-doc      prose  /usr/share/doc: READMEs, NEWS, changelogs, .txt/.md/.rst/.html (gzipped or not;
                         HTML stripped to text; licence files left out)
Any directory can be added as a source of code, prose or both (`parse_source`), e.g. Debian documentation
packages or npm packages unpacked there: a head drafts well only on the kind of text it was trained on.
Code is source files by suffix (CODE_SUFFIXES); minified or generated files (average line over
MAX_MEAN_LINE characters) are left out.

Deterministic: files are listed sorted, read in a seeded shuffle until each source has its equal share of
the size limit, cut into chunks at line boundaries, deduplicated, then all chunks shuffled with the seed.
A held-out split (`heldout`) sets whole files aside, spread over the sources: one prompt from each, and none
of their chunks in the rows, so a head trained on the rows is evaluated on files it never saw.
Evaluation data stays out: files whose path names a benchmark (HumanEval, MBPP, MT-Bench, GSM8K), and any
chunk that contains one of this package's benchmark prompts (`specdec/prompts/bench.jsonl`) whole or shares
a run of 13 words with one (the n-gram overlap test of GPT-3's contamination study).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass, field
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path

from specdec.errors import SpecdecError

BENCHMARK_PATH = re.compile(r"human[-_ ]?eval|mbpp|(?<![a-z])mt[-_ ]?bench|gsm[-_ ]?8k", re.IGNORECASE)
OVERLAP_WORDS = 13
MAX_FILE_CHARS = 32_768  # the start of a long file: one changelog must not fill a source's share
MIN_CHUNK_CHARS = 200  # shorter chunks (an empty __init__.py, a one-line NEWS) make no useful prompt
MAX_MEAN_LINE = 300  # characters: longer lines on average mean minified or generated code, not prompts
CODE_SUFFIXES = (".py", ".pyi", ".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".sql", ".sh", ".c", ".h", ".cc",
                 ".cpp", ".hpp", ".go", ".rs", ".java", ".kt", ".rb", ".php", ".lua", ".swift", ".cs")
PROSE_SUFFIXES = (".txt", ".md", ".rst", ".html", ".htm")
PROSE_NAMES = ("readme", "news", "changelog", "changes", "faq", "todo")
KINDS = ("code", "prose", "any")
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}  # the stdlib directory holds site-packages


@dataclass(frozen=True)
class CorpusSource:
    """One directory tree of text: `kind` "code" takes its source files, "prose" its documentation files, "any"
    both."""

    name: str
    kind: str
    root: Path

    def files(self) -> list[Path]:
        """Candidate files, sorted; symlinked directories are not followed (/usr/share/doc has many)."""
        found = []
        for directory, subdirs, names in os.walk(self.root):
            subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
            found += [Path(directory, n) for n in names if self._wanted(n[:-3] if n.endswith(".gz") else n)]
        return sorted(p for p in found if p.is_file())

    def _wanted(self, name: str) -> bool:
        code = is_code(name)
        prose = not code and (name.lower().endswith(PROSE_SUFFIXES) or name.lower().startswith(PROSE_NAMES))
        return {"code": code, "prose": prose, "any": code or prose}[self.kind]


def is_code(name: str) -> bool:
    """A source file by its name (gzip suffix removed); minified JS and type declarations are not prompts."""
    lower = name.lower()
    return lower.endswith(CODE_SUFFIXES) and not lower.endswith((".min.js", ".d.ts"))


def parse_source(spec: str) -> CorpusSource:
    """"DIR" (code and prose) or "DIR:code" / "DIR:prose" -> the source, named by its path."""
    root, _, kind = spec.rpartition(":") if spec.endswith(tuple(f":{k}" for k in KINDS)) else (spec, "", "any")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise SpecdecError(f"--source {spec!r}: {path} is not a directory")
    return CorpusSource(str(path), kind, path)


def default_sources() -> list[CorpusSource]:
    """The sources that exist on this machine."""
    paths = sysconfig.get_paths()
    candidates = [
        CorpusSource("stdlib", "code", Path(paths["stdlib"])),
        CorpusSource("site-packages", "code", Path(paths["purelib"])),
        CorpusSource("debian-doc", "prose", Path("/usr/share/doc")),
    ]
    return [s for s in candidates if s.root.is_dir()]


@dataclass
class Corpus:
    """`rows`: {"text", "source"} dicts, shuffled. `sources`: what each source gave (for the manifest).
    `excluded`: chunks and files left out, by why. `heldout`: {"prompt", "source"} dicts, one per held-out file."""

    rows: list[dict]
    sources: list[dict]
    excluded: dict[str, int] = field(default_factory=dict)
    heldout: list[dict] = field(default_factory=list)

    def describe(self) -> dict:
        return {"kind": "corpus", "sources": self.sources, "excluded": self.excluded, "rows": len(self.rows),
                "heldout_files": len(self.heldout)}


def build_corpus(sources: list[CorpusSource] | None = None, max_bytes: int = 16 << 20, seed: int = 0,
                 chunk_chars: int = 1024, heldout: int = 0) -> Corpus:
    """Read up to `max_bytes` of text (an equal share per source) into chunks of about `chunk_chars`, and set
    `heldout` files aside (split_heldout)."""
    if heldout < 0:
        raise SpecdecError(f"heldout must be >= 0, got {heldout}")
    sources = default_sources() if sources is None else sources
    share = max_bytes // max(len(sources), 1)
    guard = BenchmarkGuard.packaged()
    seen: set[str] = set()
    excluded = {"benchmark_path": 0, "benchmark_text": 0, "duplicate": 0, "minified": 0, "held_out": 0}
    rows, described = [], []
    for source in sources:
        files = source.files()
        random.Random(f"{seed}/{source.name}").shuffle(files)
        used = {"name": source.name, "kind": source.kind, "root": str(source.root), "files": 0, "chars": 0, "chunks": 0}
        for path in files:
            if used["chars"] >= share:
                break
            relative = path.relative_to(source.root).as_posix()
            if BENCHMARK_PATH.search(relative):
                excluded["benchmark_path"] += 1
                continue
            text = read_text(path)
            if not text:
                continue
            if is_code(path.name) and len(text) > MAX_MEAN_LINE * (text.count("\n") + 1):
                excluded["minified"] += 1
                continue
            used["files"] += 1
            used["chars"] += len(text)
            for i, chunk in enumerate(chunk_text(text, chunk_chars)):
                key = hashlib.sha1(" ".join(chunk.split()).encode()).hexdigest()
                if key in seen:
                    excluded["duplicate"] += 1
                elif guard.contaminated(chunk):
                    excluded["benchmark_text"] += 1
                else:
                    seen.add(key)
                    rows.append({"text": chunk, "source": f"corpus:{source.name}:{relative}#{i}"})
                    used["chunks"] += 1
        described.append(used)
    kept, held = split_heldout(rows, [s.name for s in sources], heldout, seed)
    excluded["held_out"], rows = len(rows) - len(kept), kept  # chunks of the held-out files
    random.Random(seed).shuffle(rows)
    return Corpus(rows, described, excluded, held)


def _file_of(row: dict) -> str:
    return row["source"].rsplit("#", 1)[0]  # corpus:SOURCE:PATH#CHUNK


def split_heldout(rows: list[dict], source_names: list[str], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Set `count` files aside, as evenly over the sources as their files allow (seeded): -> (the rows of every
    other file, one prompt per held-out file: its first chunk)."""
    if not count:
        return rows, []
    first_chunk: dict[str, dict] = {}
    for row in rows:
        first_chunk.setdefault(_file_of(row), row)
    by_source = {name: sorted(f for f in first_chunk if f.startswith(f"corpus:{name}:")) for name in source_names}
    if count > len(first_chunk) - 1:
        raise SpecdecError(f"cannot hold out {count} files: the corpus has {len(first_chunk)}, and one must stay")
    rng = random.Random(f"{seed}/heldout")
    for files in by_source.values():
        rng.shuffle(files)
    chosen: list[str] = []
    while len(chosen) < count:  # round robin over the sources, skipping those out of files
        for files in by_source.values():
            if files and len(chosen) < count:
                chosen.append(files.pop())
    held = set(chosen)
    prompts = [{"prompt": first_chunk[f]["text"], "source": first_chunk[f]["source"]} for f in chosen]
    return [row for row in rows if _file_of(row) not in held], prompts


def heldout_path(rows_path: Path) -> Path:
    """Where a written corpus's held-out prompts lie: corpus.jsonl -> corpus.heldout.jsonl."""
    return rows_path.with_name(rows_path.stem + ".heldout.jsonl")


def manifest_path(rows_path: Path) -> Path:
    """Where a written corpus's description lies: corpus.jsonl -> corpus.manifest.json."""
    return rows_path.with_name(rows_path.stem + ".manifest.json")


def write_corpus(corpus: Corpus, out: Path) -> None:
    """The rows as JSONL ({"text", "source"} a line, what `distill --prompts` reads), the description beside
    them, and the held-out prompts if any ({"prompt", "source"}, what `bench --prompts` reads); each file is
    written whole under a temporary name first, so a killed run leaves no partial corpus."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def jsonl(rows):
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    files = [(out, jsonl(corpus.rows)), (manifest_path(out), json.dumps(corpus.describe(), indent=1) + "\n")]
    if corpus.heldout:
        files.append((heldout_path(out), jsonl(corpus.heldout)))
    else:  # an earlier corpus's held-out files may be among these rows
        heldout_path(out).unlink(missing_ok=True)
    for path, text in files:
        partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)


def read_text(path: Path) -> str | None:
    """A file's text (gunzipped, HTML stripped), its first MAX_FILE_CHARS; None for binary or unreadable
    files."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = data.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError):
        return None
    if "\x00" in text:
        return None
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    if name.lower().endswith((".html", ".htm")):
        text = html_to_text(text)
    return text[:MAX_FILE_CHARS]


class _TextExtractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._hidden = 0  # inside <script>/<style>

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._hidden += 1
        elif tag in ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "dt", "dd"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._hidden = max(self._hidden - 1, 0)

    def handle_data(self, data):
        if not self._hidden:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    """The visible text of an HTML page, one paragraph a line."""
    parser = _TextExtractor()
    parser.feed(html)
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Consecutive pieces of about `chunk_chars`, cut between lines (a longer line is cut where it must);
    pieces under MIN_CHUNK_CHARS of text are dropped."""
    chunks, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line) > chunk_chars:
            chunks.append(line[:chunk_chars])
            line = line[chunk_chars:]
        if size + len(line) > chunk_chars and current:
            chunks.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    chunks.append("".join(current))
    return [c for c in chunks if len(c.strip()) >= MIN_CHUNK_CHARS]


class BenchmarkGuard:
    """Recognises text that contains an evaluation prompt: whole, or a run of OVERLAP_WORDS of its words
    (whitespace-normalised, so re-indented or re-wrapped copies are caught too)."""

    def __init__(self, prompts: list[str]):
        self.prompts = [" ".join(p.split()) for p in prompts if p.strip()]
        self.ngrams = {g for p in self.prompts for g in _ngrams(p.split())}

    @classmethod
    def packaged(cls) -> "BenchmarkGuard":
        """The guard for this package's benchmark prompts."""
        text = (resources.files("specdec") / "prompts" / "bench.jsonl").read_text(encoding="utf-8")
        return cls([json.loads(line)["prompt"] for line in text.splitlines() if line.strip()])

    def contaminated(self, text: str) -> bool:
        words = text.split()
        normal = " ".join(words)
        return any(p in normal for p in self.prompts) or not self.ngrams.isdisjoint(_ngrams(words))


def _ngrams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + OVERLAP_WORDS]) for i in range(len(words) - OVERLAP_WORDS + 1)}
