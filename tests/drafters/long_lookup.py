"""The example drafter kind of docs/drafters.md ("Adding a drafter kind"), which tests/drafters/test_registry.py
registers: a module offering open_drafter."""

from specdec.drafters.ngram import NgramSource


def open_drafter(path, target_path):
    """Prompt lookup that trusts matches of 4 to 8 tokens only."""
    return NgramSource(min_ngram=4, max_ngram=8)
