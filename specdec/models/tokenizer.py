"""Tokenizer: a `tokenizers` tokenizer plus the checkpoint's chat template (rendered with jinja2).

`Tokenizer.from_dir` reads a HF directory (tokenizer.json + tokenizer_config.json), in this process or, for a
short command's cold start, in a child process (`in_child`). `tokenizer_files_from_gguf` rebuilds those two
files from a GGUF's `tokenizer.ggml.*` metadata, for `gguf_import`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import weakref
from datetime import datetime
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as _BackendTokenizer

from specdec.errors import SpecdecError

# The turn terminator of Gemma chat models; released Gemma 3 configs stop on it as well as on <eos>.
END_OF_TURN = "<end_of_turn>"
SPIECE_SPACE = "\u2581"

# llama.cpp's token types (gguf.TokenType)
_CONTROL = 3
_USER_DEFINED = 4


class Tokenizer:
    """Encode/decode text for a checkpoint directory, and render its chat template.

    `eos_ids` are the stop tokens as HF generation picks them: generation_config.json's, else config.json's
    `eos_token_id`, else the eos token plus <end_of_turn> when the vocabulary has it. Released Gemma 3
    checkpoints say [1, 106] (<eos>, <end_of_turn>), and the GGUF import writes the same."""

    def __init__(
        self,
        backend: _BackendTokenizer | ChildBackend,
        config: dict[str, Any],
        eos_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        source: str = "tokenizer",
    ):
        self._backend = backend
        self._source = source
        self._special_tokens = {name: _token_content(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self._eos_ids = tuple(eos_ids) if eos_ids else None
        self.chat_template = chat_template

    # Looked up on first use: a backend in a child process answers once it has parsed the file.
    @cached_property
    def bos_id(self) -> int | None:
        return self._id_of(self._special_tokens["bos_token"])

    @cached_property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids or self._default_eos_ids()

    @classmethod
    def from_dir(cls, path: str | Path, in_child: bool = False) -> "Tokenizer":
        """`in_child`: parse and run the tokenizer in a child process (ChildBackend), so that this process goes
        on loading the engine meanwhile; a malformed file then raises on first use."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise SpecdecError(f"{directory}: no tokenizer.json")
        if in_child:
            backend = ChildBackend(tokenizer_file)
        else:
            from specdec.models.tokenizer_child import parse

            try:
                backend = parse(str(tokenizer_file))
            except ValueError as e:
                raise SpecdecError(f"{tokenizer_file}: {e}") from None
        config = _read_json(directory / "tokenizer_config.json") or {}
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else _pick_template(config.get("chat_template"))
        return cls(backend, config, eos_ids=_eos_ids_from_configs(directory), chat_template=template, source=str(directory))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; with `add_bos`, exactly one BOS leads (none is added when the text already
        starts with one, as a rendered chat template does)."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the checkpoint's template, as HF does."""
        if self.chat_template is None:
            raise SpecdecError(f"{self._source}: no chat template (a base model? pass plain text instead)")
        from jinja2 import TemplateError

        try:
            template = _jinja_env().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._special_tokens, **extra)
        except TemplateError as e:
            raise SpecdecError(f"{self._source}: chat template failed: {e}") from None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _default_eos_ids(self) -> tuple[int, ...]:
        ids = [self._id_of(self._special_tokens["eos_token"]), self._id_of(END_OF_TURN)]
        return tuple(i for i in ids if i is not None)


class ChildBackend:
    """The `tokenizers` calls Tokenizer makes (get_vocab_size, encode, decode, token_to_id), answered by a child
    process that parses tokenizer.json. The parse holds the GIL (1.4 s for Gemma's 262,144 pieces and 514,906
    merges on a CPU core), so in a thread it overlaps nothing this process does in Python; in a process it runs
    on another core while the engine loads. Each call is one JSON line each way (about 0.1 ms): right for a
    short command's prompt and streamed text, not for a server's traffic. The child exits when this
    process closes its input, or dies."""

    def __init__(self, tokenizer_file: Path):
        self._file = tokenizer_file
        # Run as a script, not a module of the package: the child imports tokenizers alone, whatever the path.
        child = Path(__file__).with_name("tokenizer_child.py")
        self._process = subprocess.Popen([sys.executable, str(child), str(tokenizer_file)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, encoding="utf-8")
        self._lock = threading.Lock()
        weakref.finalize(self, _stop_child, self._process)

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._process.stdin.write(json.dumps([method, *args]) + "\n")
                self._process.stdin.flush()
                line = self._process.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
        if not line:
            raise SpecdecError(f"{self._file}: the tokenizer's process exited (code {self._process.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise SpecdecError(f"{self._file}: {reply['error']}")
        return reply["ok"]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._call("get_vocab_size", with_added_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(ids=self._call("encode", text, add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._call("decode", ids, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._call("token_to_id", token)


def _stop_child(process: subprocess.Popen) -> None:
    try:
        process.stdin.close()  # the child's loop ends
        process.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):  # a dead child: unflushed input, a broken pipe
        process.kill()
        process.wait()


class StreamDecoder:
    """Turns a growing list of token ids into text increments for streaming output.

    A trailing U+FFFD is held back: it is a multi-byte character whose byte-fallback tokens are still arriving.
    Each step decodes from one chunk before the unemitted tokens (vLLM's prefix/read offsets), so tokenizers
    whose decoding depends on the preceding token stay right, without re-decoding the whole sequence."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context chunk
        self._read = 0  # tokens before this are fully emitted
        self._partial = 0  # characters already emitted from the tokens after `_read`

    def push(self, ids: Iterable[int]) -> str:
        """Add new token ids; return the text they complete (possibly empty)."""
        self._ids.extend(ids)
        done = len(self._decode(self._prefix, self._read)) + self._partial
        text = self._decode(self._prefix, len(self._ids))
        stable = text.rstrip("\ufffd")
        new = stable[done:]
        if stable == text:
            self._prefix, self._read, self._partial = self._read, len(self._ids), 0
        else:
            self._partial += len(new)
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        done = len(self._decode(self._prefix, self._read)) + self._partial
        text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        self._partial = 0
        return text[done:]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as a serialized AddedToken."""
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"{path}: unreadable JSON ({e})") from None


def _pick_template(template: Any) -> str | None:
    """A string, or HF's list of named templates (the one named "default")."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


def _eos_ids_from_configs(directory: Path) -> tuple[int, ...] | None:
    """Stop tokens the way HF generation picks them: generation_config.json, then config.json."""
    for name in ("generation_config.json", "config.json"):
        eos = (_read_json(directory / name) or {}).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return None


def _jinja_env():
    """The sandboxed environment HF renders chat templates in, with its helpers."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# --- GGUF ---------------------------------------------------------------------------------------------


def tokenizer_files_from_gguf(reader, source: str = "GGUF") -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json (file name -> text) for the SentencePiece-style BPE vocabulary
    in a GGUF's metadata (`reader`: a gguf.GGUFReader), shaped like Gemma's own tokenizer.json: spaces
    normalised to U+2581, byte fallback, control tokens special, user-defined tokens matched whole."""
    meta = lambda key, default=None: gguf_field(reader, "tokenizer.ggml." + key, default)  # noqa: E731
    model = meta("model")
    if model != "llama":
        raise SpecdecError(f"{source}: unsupported tokenizer model {model!r} (only SentencePiece 'llama' vocabularies)")
    tokens = meta("tokens")
    if not tokens:
        raise SpecdecError(f"{source}: no tokenizer.ggml.tokens")
    token_types = meta("token_type") or [1] * len(tokens)
    # llama.cpp stores Gemma's space-run tokens with real spaces; the normalizer turns spaces into U+2581.
    space_runs = {i for i, t in enumerate(tokens) if t and set(t) == {" "}}
    tokens = [SPIECE_SPACE * len(t) if i in space_runs else t for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    stored_merges = meta("merges")
    merges = [m.split(" ", 1) for m in stored_merges] if stored_merges else _merges_from_vocab(tokens, vocab)

    def special(key: str) -> str | None:
        token_id = meta(key + "_token_id")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    # Control and user-defined tokens are matched whole in the raw text. The space runs stay with the BPE model:
    # SentencePiece matches them after normalisation, which BPE's merges reproduce (so does transformers).
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": kind == _CONTROL}
        for i, (t, kind) in enumerate(zip(tokens, token_types))
        if kind in (_CONTROL, _USER_DEFINED) and i not in space_runs
    ]
    add_bos = bool(meta("add_bos_token", True)) and bos is not None
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPIECE_SPACE},
        "pre_tokenizer": None,
        "post_processor": _bos_template(bos, vocab[bos]) if add_bos else None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPIECE_SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta("add_eos_token", False)),
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,  # HF's "no limit"
    }
    template = gguf_field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {
        "tokenizer.json": json.dumps(tokenizer_json, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
    }


def _merges_from_vocab(tokens: list[str], vocab: dict[str, int]) -> list[list[str]]:
    """Gemma GGUFs carry no merges. Every split of a token into two vocabulary pieces is a merge, ranked by the
    token's position in the vocabulary (Gemma's scores do not follow merge order; positions do), then by the
    longer left piece -- the same order transformers' GGUF converter derives."""
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append([left, right])
    return merges


def _bos_template(bos: str, bos_id: int) -> dict[str, Any]:
    """Post-processor that prepends BOS, for HF loaders of the written tokenizer.json (ours adds BOS itself)."""
    piece = lambda type_id: {"SpecialToken": {"id": bos, "type_id": type_id}}  # noqa: E731
    seq = lambda name, type_id: {"Sequence": {"id": name, "type_id": type_id}}  # noqa: E731
    return {
        "type": "TemplateProcessing",
        "single": [piece(0), seq("A", 0)],
        "pair": [piece(0), seq("A", 0), piece(1), seq("B", 1)],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """One metadata value of a gguf.GGUFReader as a Python value (a list for arrays)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
