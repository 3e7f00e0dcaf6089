"""Provenance for results people look at: the commit, the date, the device."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The checkout's commit; SPECDEC_COMMIT where the tree travelled without its .git (GPU runs)."""
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
