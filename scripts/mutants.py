"""Mutation testing by hand: plant known bugs one at a time and check that the tests meant to catch them fail.

Each mutant of scripts/mutants.toml (a small realistic bug) is planted alone into a fresh copy of the tree and run
against its tests. A mutant the tests let through is a blind spot: write the test that catches it (and keep the
mutant in the list, so the blind spot stays closed).

    python scripts/mutants.py                     # every mutant, against the working tree (uncommitted edits too)
    python scripts/mutants.py --list              # names, files and tests
    python scripts/mutants.py --only NAME [--only NAME ...]
    python scripts/mutants.py --rev HEAD          # plant into a commit instead
    python scripts/mutants.py --only NAME --tests 'tests/test_x.py -k new'   # does this test catch it?

Each mutant names a file, a text that occurs exactly once in it, the text that replaces it, and the pytest arguments
that should catch it (run with -x: the first failure is enough). Caught: pytest reports failures (exit 1).
Survived: the tests pass. Anything else (the text not found, a collection error, a timeout) is an error, since it
says nothing about the tests. The copy's package is imported, not the checkout's (checked in each copy).
The whole list took 5.5 minutes on 2 shared cores with OMP_NUM_THREADS=1 (where other work shares the cores, torch's
2 threads wait on each other: twenty times slower): not part of the suite, and pytest never collects it (it runs
tests/ only). Exit status 1 if any mutant survived or errored.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTANTS = Path(__file__).with_suffix(".toml")


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    result: str  # caught | survived | error
    seconds: float
    detail: str  # the failing tests, or what went wrong


def load_mutants(path: Path = MUTANTS) -> list[Mutant]:
    entries = tomllib.loads(path.read_text())["mutant"]
    mutants = [Mutant(e["name"], e["why"], e["file"], e["old"], e["new"], tuple(e["tests"])) for e in entries]
    names = [m.name for m in mutants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"{path}: mutant names used twice: {', '.join(duplicates)}")
    return mutants


def copy_tree(dest: Path, rev: str | None) -> None:
    """The tree into `dest`: commit `rev`'s files, or the working tree's (tracked and untracked files git does not
    ignore: no virtual environment, no caches)."""
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


def plant(root: Path, mutant: Mutant) -> str | None:
    """Write the mutant into the copy at `root`; None, or why it cannot be planted."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file}: no such file"
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"{mutant.file}: the old text occurs {count} times (once expected)"
    path.write_text(text.replace(mutant.old, mutant.new))
    return None


def copy_env(root: Path) -> dict[str, str]:
    """The copy's package first on the path, for pytest and the subprocesses the tests start; no bytecode written
    (a .pyc of the mutated file could outlive it)."""
    return dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")


def imports_the_copy(root: Path, mutant: Mutant) -> str | None:
    """None if `import specdec` in the copy's environment finds the copy's package (not the checkout's editable
    install), and the mutated file is the one imported; else what it found."""
    module = mutant.file.removesuffix(".py").replace("/", ".") if mutant.file.startswith("specdec/") else "specdec"
    found = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"], cwd=root,
                           env=copy_env(root), capture_output=True, text=True)
    where = found.stdout.strip()
    if found.returncode or not Path(where).resolve().is_relative_to(root.resolve()):
        return f"`import {module}` found {where or found.stderr.strip()[-300:]}, not the copy's"
    return None


def failed_tests(output: str) -> str:
    failed = [line.split(" - ")[0].removeprefix("FAILED ").removeprefix("ERROR ")
              for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return ", ".join(failed)


def run_mutant(mutant: Mutant, rev: str | None, timeout: float, tests: list[str] | None = None) -> Outcome:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        root = Path(tmp)
        copy_tree(root, rev)
        problem = plant(root, mutant) or imports_the_copy(root, mutant)
        if problem:
            return Outcome("error", time.perf_counter() - start, problem)
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *(tests or mutant.tests)]
        try:
            proc = subprocess.run(command, cwd=root, env=copy_env(root), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome("error", time.perf_counter() - start, f"pytest ran past {timeout:.0f} s")
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode == 1:
        return Outcome("caught", seconds, failed_tests(output))
    if proc.returncode == 0:
        return Outcome("survived", seconds, output.strip().splitlines()[-1])
    return Outcome("error", seconds, f"pytest exit {proc.returncode}: {output.strip()[-600:]}")


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutant (repeatable)")
    parser.add_argument("--rev", help="plant into this commit's files instead of the working tree's")
    parser.add_argument("--tests", help="pytest arguments to run instead of the mutants' own (one string)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds of pytest a mutant (default 1200)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the copy is deleted, pytest killed

    mutants = load_mutants()
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in mutants})
        if unknown:
            parser.error(f"unknown mutants: {', '.join(unknown)} (see --list)")
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name}\n    {m.why}\n    {m.file}; tests: {' '.join(m.tests)}")
        return 0

    rev = None
    if args.rev:  # one commit for every mutant, however the branch moves while they run
        resolved = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                                   f"{args.rev}^{{commit}}"], capture_output=True, text=True)
        if resolved.returncode:
            parser.error(f"--rev {args.rev}: not a commit")
        rev = resolved.stdout.strip()
    print(f"planting into {f'commit {rev}' if rev else 'the working tree'}")
    rows = [("mutant", "result", "seconds", "caught by / detail")]
    for m in mutants:
        print(f"{m.name} ...", end=" ", flush=True)
        outcome = run_mutant(m, rev, args.timeout, shlex.split(args.tests) if args.tests else None)
        print(f"{outcome.result} ({outcome.seconds:.0f} s)", flush=True)
        rows.append((m.name, outcome.result, f"{outcome.seconds:.0f}", outcome.detail.replace("\n", " ")))
    print()
    print(table(rows))
    results = [row[1] for row in rows[1:]]
    print(f"\n{results.count('caught')} caught, {results.count('survived')} survived, {results.count('error')} errors "
          f"of {len(results)}")
    return 0 if all(r == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
