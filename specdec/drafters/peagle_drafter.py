"""The P-EAGLE drafter kind (specdec.drafters.registry): an EAGLE-3 head trained to propose all its drafts in one
forward (specdec.drafters.eagle3's docstring), run by the EAGLE-3 drafter's torch and JAX device states."""

from __future__ import annotations

from pathlib import Path

from specdec.drafters.eagle3_drafter import Eagle3Source


def open_drafter(path: Path, target_path: Path) -> Eagle3Source:
    """The registry's entry (specdec.drafters.registry)."""
    return Eagle3Source(path, target_path, parallel=True)
