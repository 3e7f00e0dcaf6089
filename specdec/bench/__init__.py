"""The measurement harness: `specdec bench` (decode, ours beside the peers), `specdec roofline` (a decode step
against the bytes it reads), the load generator of `specdec serve` (serve_load), and the one way they run work in a
process of its own (child)."""


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """The index of the first token where two outputs differ (a length difference counts), None if equal."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(reference), len(tokens)))
