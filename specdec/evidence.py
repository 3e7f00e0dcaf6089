"""Provenance for results people look at: the commit, the date, the device."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path


def git_commit(tree: Path = Path(__file__).parent) -> str | None:
    """The checkout's commit, with "+changes" where the files under `tree` (the package, by default) differ from it,
    so that a result measured on uncommitted code says so; SPECDEC_COMMIT where the tree travelled without its .git
    (GPU runs)."""
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree,
                             check=True)
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], capture_output=True, cwd=tree)
    except (OSError, subprocess.CalledProcessError):
        return None
    commit = out.stdout.strip()
    return (commit + "+changes" if changed.returncode == 1 else commit) or None


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
