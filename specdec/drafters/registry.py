"""The drafter kinds: the one list of them, read by `generate`, `validate`, `bench`, `serve` and the CLI's help.

A kind lives in a module of its own, which offers `open_drafter(path, target_path, **options)`: the kind's files
read once and checked against the target checkpoint, returned as a specdec.protocol.LoadedDrafter (the target
layers it taps, and `build(verifier, k, sampling)` for a verifier of either framework). A new kind is that module
and one entry in KINDS (docs/drafters.md, "Adding a drafter kind").

A spec names a drafter on the command line: "ngram", "none" (plain decoding), or KIND=DIR for a kind that reads a
directory. A server names it as vLLM's `--speculative-config` does: `method` (the kind's `vllm_method`), `model`
(its directory) and `num_speculative_tokens`, plus the kind's own options.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

NONE = "none"  # the spec of plain decoding: no drafter, one token a cycle


@dataclass(frozen=True)
class DrafterKind:
    name: str  # the spec's kind: "eagle3" in "eagle3=DIR"
    label: str  # its name in tables and plots
    summary: str  # one line for help texts
    module: str  # where it lives: its open_drafter reads the files
    directory: str | None = None  # what DIR is, for a kind that reads one
    vllm_method: str | None = None  # its method in --speculative-config
    vllm_flags: tuple[tuple[str, bool], ...] = ()  # keys that tell it from another kind of the same method
    options: tuple[str, ...] = ()  # --speculative-config keys of its own, passed to open_drafter
    wraps: str | None = None  # a composite kind: the kind whose drafter its module's open_drafter takes, loaded

    @property
    def spec(self) -> str:
        return f"{self.name}=DIR" if self.directory else self.name

    def open(self, path: Path | None, target_path: Path | None, options: dict[str, Any]):
        """The kind's files read and checked against the target: a specdec.protocol.LoadedDrafter."""
        module = importlib.import_module(self.module)
        if self.wraps:
            return module.open_drafter(KINDS[self.wraps].open(path, target_path, {}), **options)
        return module.open_drafter(path, target_path, **options)


_KINDS = (
    DrafterKind("ngram", "n-gram", "prompt lookup in the text so far",
                "specdec.drafters.ngram", vllm_method="ngram", options=("prompt_lookup_min", "prompt_lookup_max")),
    DrafterKind("eagle3", "EAGLE-3", "an EAGLE-3 head trained for this target", "specdec.drafters.eagle3_drafter",
                "the head's directory", "eagle3"),
    DrafterKind("peagle", "P-EAGLE", "an EAGLE-3 head trained to draft all its tokens in one forward",
                "specdec.drafters.peagle_drafter", "the head's directory", "eagle3",
                vllm_flags=(("parallel_drafting", True),)),
    DrafterKind("model", "model", "a smaller Gemma of the target's tokenizer", "specdec.drafters.model",
                "the drafter checkpoint's directory", "draft_model"),
    DrafterKind("mtp", "MTP", "a Gemma 4 MTP assistant", "specdec.drafters.mtp_drafter", "the assistant checkpoint's directory",
                "mtp"),
)
# n-gram lookup first, each drafter with files where lookup finds nothing (specdec.drafters.hybrid)
HYBRIDS = tuple(DrafterKind(f"ngram+{kind.name}", f"n-gram + {kind.label}", f"n-gram lookup where it finds a "
                            f"continuation, else {kind.spec.split('=')[0]}'s drafts", "specdec.drafters.hybrid",
                            kind.directory, kind.vllm_method, kind.vllm_flags + (("ngram_first", True),),
                            ("prompt_lookup_min", "prompt_lookup_max"), wraps=kind.name)
                for kind in _KINDS if kind.directory)
KINDS = {kind.name: kind for kind in _KINDS + HYBRIDS}


def specs() -> list[str]:
    """Every spec's form: ngram, none, eagle3=DIR, ..."""
    return [KINDS["ngram"].spec, NONE] + [kind.spec for kind in KINDS.values() if kind.name != "ngram"]


def help_text(plain: bool = True) -> str:
    """The --drafter option's help: each spec and what it drafts with (the composites in one entry)."""
    parts = [f"{kind.spec} ({kind.summary})" for kind in KINDS.values() if not kind.wraps]
    parts.append("ngram+KIND=DIR (n-gram lookup where it finds a continuation, else KIND's drafts)")
    return " | ".join(parts[:1] + ([f"{NONE} (plain decoding)"] if plain else []) + parts[1:])


def parse_spec(spec: str) -> tuple[DrafterKind | None, Path | None]:
    """A spec -> (its kind, None for plain decoding; the drafter's directory, None for a kind without one)."""
    name, has_dir, path = spec.partition("=")
    if spec == NONE:
        return None, None
    kind = KINDS.get(name)
    if kind is None:
        raise SpecdecError(f"unknown drafter {spec!r} (choose from {', '.join(specs())})")
    if kind.directory is None:
        if has_dir:
            raise SpecdecError(f"--drafter {name} takes no directory, got {spec!r}")
        return kind, None
    if not path:
        raise SpecdecError(f"--drafter {name} needs {kind.directory}: {name}=DIR")
    if not Path(path).is_dir():
        raise SpecdecError(f"{path}: not a directory ({name} drafter)")
    return kind, Path(path)


def from_speculative_config(fields: dict) -> tuple[str, int, dict[str, Any]]:
    """vLLM's --speculative-config, parsed JSON -> (the drafter's spec, num_speculative_tokens, the kind's
    options); no method (or "none") is plain decoding."""
    method = fields.get("method")
    if method in (None, NONE):
        if set(fields) - {"method"}:
            raise SpecdecError(f"--speculative-config: {sorted(set(fields) - {'method'})} without a method")
        return NONE, 0, {}
    candidates = [kind for kind in KINDS.values() if kind.vllm_method == method]
    if not candidates:
        methods = dict.fromkeys(kind.vllm_method for kind in KINDS.values() if kind.vllm_method)
        raise SpecdecError(f"--speculative-config: unknown method {method!r} (supported: "
                           f"{', '.join([*methods, NONE])})")
    flags = {name for kind in candidates for name, _ in kind.vllm_flags}  # e.g. eagle3's parallel_drafting
    asked = {name: fields.get(name, False) for name in flags}
    kind = next((kind for kind in candidates if asked == {name: dict(kind.vllm_flags).get(name, False) for name in flags}),
                None)
    if kind is None:
        raise SpecdecError(f"--speculative-config: no {method} drafter with {asked}")
    known = {"method", "num_speculative_tokens", *flags, *kind.options} | ({"model"} if kind.directory else set())
    if unknown := set(fields) - known:
        raise SpecdecError(f"--speculative-config: unknown keys {sorted(unknown)} for method {method!r} "
                           f"(known: {', '.join(sorted(known))})")
    k = fields.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SpecdecError(f"--speculative-config: {method} needs an integer num_speculative_tokens >= 1")
    spec = kind.name
    if kind.directory:
        model = fields.get("model")
        if not isinstance(model, str) or not model:
            raise SpecdecError(f"--speculative-config: {method} needs \"model\": {kind.directory}")
        spec = f"{kind.name}={model}"
    return spec, k, {name: fields[name] for name in kind.options if name in fields}


class DrafterSource:
    """The drafter a spec names, for one target checkpoint: its files read once and checked against the target
    (its kind's open_drafter), then built for any verifier of that target with `build(verifier, k, sampling)`
    (None for plain decoding). `options`: the kind's own (registry.DrafterKind.options)."""

    def __init__(self, spec: str, target_path: str | Path | None = None, **options):
        from specdec.models.gguf_import import resolve_checkpoint

        self.spec = spec
        self.kind, self.path = parse_spec(spec)
        if options and (self.kind is None or set(options) - set(self.kind.options)):
            raise SpecdecError(f"drafter {spec!r} takes no options {sorted(options)}")
        self.options = options
        # a kind that reads the target's files needs its path; n-gram and plain decoding do not
        self.target_path = resolve_checkpoint(target_path) if self.path is not None else target_path
        self._loaded = None

    @property
    def name(self) -> str:
        return self.kind.name if self.kind is not None else NONE

    @property
    def loaded(self):
        if self._loaded is None:
            self._loaded = self.kind.open(self.path, self.target_path, self.options)
        return self._loaded

    @property
    def samples_drafts(self) -> bool:
        """Whether a sampled run draws its drafts from the drafter's own distribution (which `validate` then
        gates end to end), rather than proposing them from the text."""
        return self.kind is not None and self.loaded.samples_drafts

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (load the target with them)."""
        return () if self.kind is None else tuple(self.loaded.taps)

    def build(self, verifier, k: int, sampling=None):
        """The drafter for this verifier, k and sampling settings (None: greedy); None for plain decoding."""
        from specdec.sampling import SamplingParams

        if self.kind is None:
            return None
        if self.taps and tuple(verifier.hidden_layers) != self.taps:
            raise SpecdecError(f"{self.path}: the target was loaded without the drafter's hidden layers "
                               f"{list(self.taps)} (load it with hidden_layers=DrafterSource(spec, target).taps)")
        return self.loaded.build(verifier, k, sampling or SamplingParams())
