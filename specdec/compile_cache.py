"""Compiled programs persist in the user's cache directory, so only a machine's first run compiles.

- JAX: XLA's persistent compilation cache. Its key is the program itself (shapes and dtypes included),
  the backend, the device and the jax/jaxlib versions; weights are arguments, not constants, so one
  entry serves every checkpoint of a shape.
- PyTorch: inductor's FX-graph and autotuning caches, keyed likewise by graph, shapes, dtypes and the
  torch version.

`SPECDEC_CACHE` moves the directory (default ~/.cache/specdec); a cache the user already points
elsewhere (`TORCHINDUCTOR_CACHE_DIR`, `jax_compilation_cache_dir`) is left alone.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

from specdec.models.gguf_import import cache_dir

_jax_events: Counter = Counter()
_JAX_HIT, _JAX_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def enable_torch() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def enable_jax() -> None:
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        # Cache every program: a run compiles some twenty small ones (casts, the acceptance rules) at
        # 15-50 ms each, 0.6 s in all on an H200, which the default threshold (1 s) compiles every run.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.monitoring.register_event_listener(_count_jax_event)


def _count_jax_event(event: str, **_metadata) -> None:
    if event in (_JAX_HIT, _JAX_MISS):
        _jax_events[event] += 1


@dataclass
class CompileReport:
    """Persistent-cache hits and misses of the compilations in a block, where the framework reports them."""

    hits: int = 0
    misses: int = 0

    @property
    def label(self) -> str:
        if self.misses and self.hits:
            return f"{self.hits} cached, {self.misses} compiled"
        return "cache miss" if self.misses else "cache hit" if self.hits else ""


@contextmanager
def watch(engine_name: str):
    """Count the cache hits and misses of the compilations inside the block."""
    report = CompileReport()
    if engine_name == "jax":
        before = Counter(_jax_events)
        yield report
        report.hits, report.misses = (_jax_events[e] - before[e] for e in (_JAX_HIT, _JAX_MISS))
        return
    if "torch._dynamo" not in sys.modules:  # nothing compiles; importing dynamo alone costs seconds
        yield report
        return
    from torch._dynamo.utils import counters

    before = Counter(counters["inductor"])
    yield report
    after = counters["inductor"]
    report.hits, report.misses = (after[e] - before[e] for e in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
