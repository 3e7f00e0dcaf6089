"""The docs check: README.md and docs/*.md cite files that exist and show commands the CLI accepts.

- Every relative link and image resolves (to a file or a folder of the repository, and to a heading where it names
  one); every `docs/results/...`, `scripts/...`, `specdec/...` and `tests/...` path the pages name exists.
- Every `specdec SUBCOMMAND ...` shown in a code block or in inline code uses only flags that subcommand takes, read
  from the typer app (and from argparse for `roofline`, which hands its arguments on), and parses as a shell line.
- The journal (docs/journal/, history): its links resolve; a `docs/results/...` path it names exists, unless the text
  says "(at commit C)", in which case it is checked at commit C where this clone has that commit.
- The bars: a README of at most 150 lines that defines tau, a benchmarks page of at most 400, at most 150 records.

The checker's functions take text and a root, so the tests at the end show it catching a missing file, a missing
flag and an unknown subcommand on small fake pages.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import re
import shlex
import subprocess
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Flags the docs show ahead of the code that will take them: (subcommand path) -> flags. An entry can go once the
# CLI has the flag; until then the pages may show it.
# Subcommands that hand their arguments to a parser of their own: subcommand -> module whose main(argv) builds it.
FORWARDED = {"roofline": "specdec.bench.roofline"}
NOT_SHELL = {"python", "py", "json", "yaml", "yml", "toml", "jinja"}  # fenced blocks whose lines are not commands

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]+`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
REPO_PATH = re.compile(r"(?<![\w./-])((?:docs/results|scripts|specdec|tests)/[\w./-]*[\w/])")
RESULTS_REF = re.compile(r"(?<![\w/.\-])docs/results/[A-Za-z0-9_.{},*\[\]\-]+")
SIBLINGS = re.compile(r"(?:\s*(?:/|,|,? and)\s*`[.-][^`]+`)*")
AT_COMMIT = re.compile(r"\s*\(at commit ([0-9a-f]{7,40})\)")


# --- the pages -------------------------------------------------------------------------------------------------------


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def journal_pages(root: Path) -> list[Path]:
    return sorted((root / "docs" / "journal").glob("*.md"))


def blank_fences(text: str) -> str:
    """The text with each fenced block's lines emptied (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a linked heading anchors on its label
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(blank_fences(text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


# --- links and paths -------------------------------------------------------------------------------------------------


def check_links(page: Path, text: str, root: Path) -> list[str]:
    """Relative links and images that name no file or folder of the repository, or no heading of their page."""
    problems = []
    for m in LINK.finditer(blank_fences(text)):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        where = f"{page.relative_to(root)}: link {target}"
        if not dest.is_relative_to(root.resolve()) or not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root.resolve())}")
    return problems


def check_paths(page: Path, text: str, root: Path) -> list[str]:
    """Repository paths (docs/results/..., scripts/..., specdec/..., tests/...) named in a page that do not exist."""
    problems = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if not (root / path).exists():
            problems.append(f"{page.relative_to(root)}: {path}: no such file")
    return problems


def expand(ref: str) -> list[str]:
    """A reference's file names: {a,b} alternatives and [optional] parts spelled out."""
    if m := re.search(r"\{([^}]*)\}", ref):
        return [e for alt in m.group(1).split(",") for e in expand(ref[: m.start()] + alt + ref[m.end():])]
    if m := re.search(r"\[([^\]]*)\]", ref):
        return expand(ref[: m.start()] + ref[m.end():]) + expand(ref[: m.start()] + m.group(1) + ref[m.end():])
    return [ref]


def results_references(text: str) -> list[tuple[str, str | None]]:
    """(reference, commit) for each docs/results reference outside fenced blocks; commit where the text says
    "(at commit C)" after it (after its code span and any `.png`-style shorthands beside it), else None."""
    text = blank_fences(text)
    spans = [(m.start(), m.end()) for m in CODE_SPAN.finditer(text)]
    out = []
    for m in RESULTS_REF.finditer(text):
        ref = m.group(0).rstrip(".,;:")
        end = m.start() + len(ref)
        span = next(((s, e) for s, e in spans if s <= m.start() < e), None)
        if span:
            end = span[1] + SIBLINGS.match(text, span[1]).end() - span[1]
        at = AT_COMMIT.match(text, end)
        out.append((ref, at.group(1) if at else None))
    return out


def check_journal_references(page: Path, text: str, root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Problems with the live references (those not marked "at commit"), and the (commit, path) pairs of the
    marked ones, to check against the history."""
    problems, history = [], []
    for ref, commit in results_references(text):
        if re.fullmatch(r"[A-Z_]+(\.\w+)?", ref.rsplit("/", 1)[1]):  # docs/results/NAME: a placeholder
            continue
        names = expand(ref)
        if commit is None:
            for name in names:
                found = list(root.glob(name)) if "*" in name else [root / name] if (root / name).exists() else []
                if not found:
                    problems.append(f"{page.relative_to(root)}: {name}: no such file (mark it '(at commit C)' "
                                    "if it left the tree)")
        else:
            if "[" not in ref:  # [optional] parts are notation: some spellings name no file
                history += [(commit, name) for name in names if "*" not in name and not name.endswith("-")]
    return problems, history


def missing_in_history(pairs: list[tuple[str, str]], root: Path) -> list[str] | None:
    """The (commit, path) pairs whose path is not in that commit; None where git or the commits are not at hand
    (an export, a shallow clone)."""
    git = ["git", "-C", str(root)]
    commits = sorted({c for c, _ in pairs})
    try:
        for commit in commits:
            if subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
                return None
        query = "".join(f"{c}:{p}\n" for c, p in pairs)
        out = subprocess.run([*git, "cat-file", "--batch-check"], input=query, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line.split()[0] for line in out.splitlines() if line.endswith(" missing")]


# --- commands --------------------------------------------------------------------------------------------------------


def shown_commands(text: str) -> list[str]:
    """Shell lines of fenced blocks (continuations joined, `$ ` prompts dropped), and inline code, that run specdec."""
    snippets = []
    for m in FENCE.finditer(text):
        if m.group(1).strip().lower() in NOT_SHELL:
            continue
        for line in m.group(2).replace("\\\n", " ").splitlines():
            snippets.append(re.sub(r"^\s*\$\s", "", line))
    snippets += [m.group(0)[1:-1] for m in CODE_SPAN.finditer(blank_fences(text))]
    return [s for s in snippets if re.search(r"(?:^|[\s/])specdec\s", s)]


def invocations(snippet: str) -> list[list[str]]:
    """The argument lists of each `specdec ...` (or `python -m specdec ...`) in a shell line; raises ValueError
    where the line does not parse."""
    lexer = shlex.shlex(snippet, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    segments, current = [], []
    for token in tokens:
        if set(token) <= set("();<>|&"):
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    out = []
    for seg in segments:
        while seg and re.match(r"[A-Za-z_]\w*=", seg[0]):  # VAR=value before the command
            seg = seg[1:]
        if seg and seg[0].rsplit("/", 1)[-1] == "specdec":
            out.append(seg[1:])
        elif "specdec" in seg and seg.index("specdec") > 0 and seg[seg.index("specdec") - 1] == "-m":
            out.append(seg[seg.index("specdec") + 1:])
    return out


def check_invocation(args: list[str], cli: dict) -> list[str]:
    """What is wrong with one `specdec` argument list: an unknown subcommand, or a flag it does not take. `cli` maps
    a subcommand to its flags (a set) or, for a group, to its subcommands (a dict)."""
    node, path, i = cli, (), 0
    while isinstance(node, dict):
        if i == len(args) or args[i].startswith("-"):
            node = {"--help"}  # `specdec --help`, `specdec train --help`
            break
        name = args[i]
        if re.fullmatch(r"[A-Z][A-Z_]*", name):  # a placeholder: `specdec COMMAND --help`
            return []
        if name not in node:
            return [f"unknown subcommand: specdec {' '.join((*path, name))}"]
        node, path, i = node[name], (*path, name), i + 1
    problems = []
    for arg in args[i:]:
        if arg == "--":
            break
        arg = arg.strip("[]()")
        if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-[\d.]+", arg):
            continue
        for flag in arg.split("/"):
            flag = flag.split("=", 1)[0]
            if flag not in node and flag != "--help":
                problems.append(f"specdec {' '.join(path)}: no flag {flag}")
    return problems


@functools.cache
def cli_flags() -> dict:
    """The CLI as check_invocation takes it, from the typer app."""
    import typer

    from specdec.cli import app

    def walk(cmd, name):
        if getattr(cmd, "commands", None):
            return {n: walk(sub, n) for n, sub in cmd.commands.items()}
        if name in FORWARDED:
            return forwarded_flags(FORWARDED[name])
        assert not (cmd.context_settings or {}).get("ignore_unknown_options"), \
            f"specdec {name} hands on its arguments: add its parser to FORWARDED"
        return {opt for p in cmd.params for opt in (*p.opts, *getattr(p, "secondary_opts", ())) if opt.startswith("-")}

    return walk(typer.main.get_command(app), "")


class _Parsed(Exception):
    pass


def forwarded_flags(module: str) -> set[str]:
    """The flags of the argparse parser that `module.main(argv)` builds, caught as it parses."""
    import importlib

    caught = {}

    def catch(parser, *args, **kwargs):
        caught["parser"] = parser
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch):
        try:
            importlib.import_module(module).main([])
        except _Parsed:
            pass
    return set(caught["parser"]._option_string_actions)


def check_commands(page: Path, text: str, root: Path, cli: dict) -> list[str]:
    problems = []
    for snippet in shown_commands(text):
        try:
            found = invocations(snippet)
        except ValueError as e:
            problems.append(f"{page.relative_to(root)}: does not parse ({e}): {snippet}")
            continue
        problems += [f"{page.relative_to(root)}: {p}: {snippet}" for args in found
                     for p in check_invocation(args, cli)]
    return problems


# --- the repository's pages ------------------------------------------------------------------------------------------


def test_the_docs_links_and_the_files_they_name_exist():
    problems = []
    for page in doc_pages(ROOT):
        text = page.read_text()
        problems += check_links(page, text, ROOT) + check_paths(page, text, ROOT)
    assert not problems, "\n".join(problems)


def test_every_command_the_docs_show_uses_flags_its_subcommand_takes():
    problems = []
    shown = 0
    for page in doc_pages(ROOT):
        text = page.read_text()
        shown += len(shown_commands(text))
        problems += check_commands(page, text, ROOT, cli_flags())
    assert shown > 20  # the check reads the pages' commands at all
    assert not problems, "\n".join(problems)


def test_the_journal_links_resolve_and_its_results_references_exist_now_or_at_their_commit():
    problems, history = [], []
    for page in journal_pages(ROOT):
        text = page.read_text()
        problems += check_links(page, text, ROOT)
        found, past = check_journal_references(page, text, ROOT)
        problems += found
        history += past
    missing = missing_in_history(history, ROOT)
    problems += [f"not in its commit: {m}" for m in missing or []]
    assert not problems, "\n".join(problems)


def test_the_bars_on_the_pages_and_the_records():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert re.search(r"\*\*tau\*\*", readme), "the README defines tau"
    assert (ROOT / "docs" / "design.md").is_file()
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 400
    assert len([p for p in (ROOT / "docs" / "results").iterdir() if p.is_file()]) <= 150


def test_the_cli_model_holds_every_subcommand_and_roofline_s_own_flags():
    cli = cli_flags()
    assert {"generate", "validate", "bench", "serve", "train", "roofline"} <= set(cli)
    assert "eagle3" in cli["train"] and "--data" in cli["train"]["eagle3"]
    assert {"--models", "--tensor-parallel", "--tp-parts"} <= cli["roofline"]
    assert {"-k", "--k", "--no-invariant"} <= cli["generate"]


# --- the checker on fake pages ---------------------------------------------------------------------------------------

FAKE_CLI = {"generate": {"--target", "-k", "--k", "--fp8", "--no-fp8"}, "train": {"eagle3": {"--data", "--out"}}}


def fake_repo(tmp_path: Path, page_text: str) -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "kept.json").write_text("{}")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading, with `code`\n")
    (tmp_path / "docs" / "page.md").write_text(page_text)
    return tmp_path / "docs" / "page.md"


def test_the_checker_catches_a_missing_file_and_a_missing_heading(tmp_path):
    page = fake_repo(tmp_path, "See [kept](results/kept.json) and [the heading](other.md#a-heading-with-code).\n")
    assert check_links(page, page.read_text(), tmp_path) == []
    page.write_text("See [gone](results/gone.json), ![plot](results/gone.png) and [x](other.md#no-such-heading).\n"
                    "The record docs/results/gone.json and scripts/gone.py.\n")
    text = page.read_text()
    problems = check_links(page, text, tmp_path) + check_paths(page, text, tmp_path)
    assert len(problems) == 5, problems
    assert sum("no such file" in p for p in problems) == 4 and "no heading #no-such-heading" in "".join(problems)


def test_the_checker_catches_a_flag_a_subcommand_does_not_take(tmp_path):
    page = fake_repo(tmp_path, "```bash\n$ specdec generate 'def f():' -k 4 --fp8 --target DIR\n"
                               "specdec train eagle3 --data d \\\n    --out o\nspecdec COMMAND --help\n```\n")
    assert check_commands(page, page.read_text(), tmp_path, FAKE_CLI) == []
    page.write_text("```bash\nspecdec generate 'def f():' --no-such-flag=3 && specdec train eagle3 --data d --steps 5\n```\n"
                    "Inline too: `specdec generate PROMPT [--gone]`, `specdec tran eagle3`, and "
                    "`python -m specdec generate 'x' --drafter ngram`.\n")
    problems = check_commands(page, page.read_text(), tmp_path, FAKE_CLI)
    expected = ["specdec generate: no flag --no-such-flag", "specdec train eagle3: no flag --steps",
                "specdec generate: no flag --gone", "unknown subcommand: specdec tran",
                "specdec generate: no flag --drafter"]
    assert len(problems) == len(expected) and all(e in p for e, p in zip(expected, problems)), problems


def test_the_checker_reports_a_command_that_does_not_parse(tmp_path):
    page = fake_repo(tmp_path, "```bash\nspecdec generate 'unclosed --fp8\n```\n")
    problems = check_commands(page, page.read_text(), tmp_path, FAKE_CLI)
    assert len(problems) == 1 and "does not parse" in problems[0]


def test_the_journal_check_tells_live_references_from_history(tmp_path):
    page = fake_repo(tmp_path, "Records: `docs/results/kept.json` / `.png` (at commit abc1234), and "
                               "`docs/results/gone.json`, and docs/results/old-{a,b}.json (at commit abc1234).\n"
                               "*Figure \"x\": docs/results/old.png (at commit def5678).*\n")
    refs = results_references(page.read_text())
    assert refs == [("docs/results/kept.json", "abc1234"), ("docs/results/gone.json", None),
                    ("docs/results/old-{a,b}.json", "abc1234"), ("docs/results/old.png", "def5678")]
    problems, history = check_journal_references(page, page.read_text(), tmp_path)
    assert problems == ["docs/page.md: docs/results/gone.json: no such file (mark it '(at commit C)' if it left "
                        "the tree)"]
    assert history == [("abc1234", "docs/results/kept.json"), ("abc1234", "docs/results/old-a.json"),
                       ("abc1234", "docs/results/old-b.json"), ("def5678", "docs/results/old.png")]
    assert missing_in_history(history, tmp_path) is None  # not a git repository: the history is not checked


@pytest.mark.parametrize("title, expected", [
    ("Rows, cycles and what a request costs", "rows-cycles-and-what-a-request-costs"),
    ("The 31B on one and two H200s, E4B, and what TP=2 does", "the-31b-on-one-and-two-h200s-e4b-and-what-tp2-does"),
    ("Running `specdec bench`", "running-specdec-bench"),
    ("a GELU + down kernel", "a-gelu--down-kernel"),
])
def test_anchors_are_githubs(title, expected):
    assert slug(title) == expected
