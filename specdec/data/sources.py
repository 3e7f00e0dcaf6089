"""Prompt sources: rows from a prompt file (JSONL, or text with one prompt a line), a local Hugging Face dataset or the
built-in corpus (specdec.data.corpus), turned into the text and token ids the target continues. Every command that
takes prompts reads them here: distill, validate and bench.

Row layouts, the first that a row has wins:
  conversations  ShareGPT: [{"from": "human"|"gpt"|"system", "value": ...}]
  messages       OpenAI / UltraChat: [{"role": "user"|"assistant"|"system", "content": ...}]
                 Both are rendered with the target's chat template, up to (not including) the final
                 assistant turn, which the target writes again; rows are skipped when it has no template.
  text           plain text, for base models: its first `prompt_tokens` tokens, cut back to a line (else a
                 word) boundary when one lies in their second half; the rest is discarded, the target
                 writes its own continuation.
  prompt         a completion prompt, used whole.
A row with none of these fields is an error (the wrong file, or a layout this module does not read).
Datasets are read locally only: a `save_to_disk` directory, data files, or a name already in the cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer

LAYOUTS = ("conversations", "messages", "text", "prompt")
PROMPT_TOKENS = 128  # of a text row, as its prompt (distill --prompt-tokens)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "chatgpt": "assistant", "system": "system"}
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

Row = tuple[str, dict]  # (where it came from, e.g. "chats.jsonl:12", the row)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    source: str


@dataclass(frozen=True)
class Skipped:
    source: str
    reason: str


class SkipRow(Exception):
    """A row that makes no prompt; the message says why."""


def jsonl_rows(path: Path) -> Iterator[Row]:
    """One JSON object a line; blank lines are skipped."""
    return _json_rows(path, _lines(path))


def prompt_file_rows(path: Path) -> Iterator[Row]:
    """The rows of a prompt file: JSONL when its first line is a JSON object, else text with one prompt a line
    (a row {"prompt": line} each); blank lines are skipped."""
    lines = _lines(path)
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise SpecdecError(f"{path}: no prompts")
    if first.lstrip().startswith("{"):
        return _json_rows(path, lines)
    return ((f"{path}:{n}", {"prompt": line}) for n, line in enumerate(lines, 1) if line.strip())


def read_prompts(path: Path, tokenizer: Tokenizer, prompt_tokens: int = PROMPT_TOKENS) -> list[str]:
    """Every row's prompt text (row_text) of a prompt file; a row that makes none is an error naming its line."""
    texts = []
    for source, row in prompt_file_rows(path):
        try:
            texts.append(row_text(row, tokenizer, prompt_tokens))
        except (SkipRow, SpecdecError) as e:
            raise SpecdecError(f"{source}: {e}") from None
    return texts


def _lines(path: Path) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{path}: cannot read prompts ({e.strerror if isinstance(e, OSError) else e})") from None


def _json_rows(path: Path, lines: list[str]) -> Iterator[Row]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise SpecdecError(f"{path}:{n}: not a JSON object")
        yield f"{path}:{n}", row


def dataset_rows(spec: str, split: str | None = None) -> Iterator[Row]:
    """Rows of a local dataset: a `save_to_disk` directory, a directory of data files, a data file
    (.jsonl/.json/.parquet/.csv), or a dataset name already in the Hugging Face cache. Nothing is downloaded:
    the hub is switched to offline mode first."""
    path = Path(spec)
    if path.is_file() and path.suffix not in DATA_FILE_BUILDERS:
        raise SpecdecError(f"{spec}: unknown data file type (use {', '.join(DATA_FILE_BUILDERS)} or a directory)")
    datasets = _offline_datasets()
    try:
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            data = datasets.load_from_disk(str(path))
        elif path.is_dir():
            data = datasets.load_dataset(str(path))
        elif path.is_file():
            data = datasets.load_dataset(DATA_FILE_BUILDERS[path.suffix], data_files=str(path))
        else:
            data = datasets.load_dataset(spec)
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, ConnectionError, DatasetNotFoundError...)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if path.exists():
            raise SpecdecError(f"{spec}: cannot load the dataset ({why})") from None
        raise SpecdecError(f"{spec}: no such file or directory, nor a dataset in the Hugging Face cache "
                           f"(nothing is downloaded): {why}") from None
    if isinstance(data, datasets.DatasetDict):
        split = split or ("train" if "train" in data else next(iter(data)))
        if split not in data:
            raise SpecdecError(f"{spec}: no split {split!r} (splits: {', '.join(data)})")
        data = data[split]
    elif split is not None:
        raise SpecdecError(f"{spec}: one dataset without splits (drop --split)")
    label = f"{spec}[{split}]" if split else spec
    for i, row in enumerate(data):
        yield f"{label}:{i}", row


def _offline_datasets():
    """The `datasets` module with the hub off, whether or not it was imported before."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def row_prompt(row: dict, tokenizer: Tokenizer, prompt_tokens: int) -> list[int]:
    """The prompt's token ids of one row (module docstring); SkipRow when the row makes none."""
    return tokenizer.encode(row_text(row, tokenizer, prompt_tokens))  # a rendered template's BOS is kept, not doubled


def row_text(row: dict, tokenizer: Tokenizer, prompt_tokens: int) -> str:
    """The prompt of one row as the text the target continues (module docstring); SkipRow when the row makes none."""
    layout = next((name for name in LAYOUTS if row.get(name) is not None), None)
    if layout is None:
        raise SpecdecError(f"no prompt field (fields: {', '.join(row) or 'none'}; "
                           f"expected one of {', '.join(LAYOUTS)})")
    value = row[layout]
    if layout in ("conversations", "messages"):
        if not tokenizer.has_chat_template:
            raise SkipRow("a conversation, and the target has no chat template")
        messages = conversation_prompt(value, sharegpt=layout == "conversations")
        try:
            return tokenizer.apply_chat_template(messages)
        except SpecdecError as e:  # e.g. a template that wants user/assistant turns to alternate
            raise SkipRow(str(e)) from None
    if not isinstance(value, str):
        raise SkipRow(f"{layout!r} is not a string")
    if layout == "text":
        value = text_prompt(value, tokenizer, prompt_tokens)
    if not value.strip():
        raise SkipRow("empty prompt")
    return value


def conversation_prompt(turns, sharegpt: bool) -> list[dict]:
    """Chat messages ({"role", "content"}) before the final assistant turn."""
    if not isinstance(turns, list) or not turns:
        raise SkipRow("empty conversation")
    messages = []
    for turn in turns:
        role, content = (turn.get("from"), turn.get("value")) if sharegpt else (turn.get("role"), turn.get("content"))
        if role not in ROLES:
            raise SkipRow(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise SkipRow("a turn without text content")
        messages.append({"role": ROLES[role], "content": content})
    if messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise SkipRow("no user turn before the assistant's")
    return messages


def text_prompt(text: str, tokenizer: Tokenizer, prompt_tokens: int) -> str:
    """The first `prompt_tokens` tokens of `text`, cut back to a line or word boundary in their second half."""
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) <= prompt_tokens:
        return text
    head = tokenizer.decode(ids[:prompt_tokens])
    for boundary in ("\n", " "):
        cut = head.rfind(boundary)
        if cut >= len(head) // 2:
            return head[: cut + 1]
    return head


def collect_prompts(rows: Iterable[Row], tokenizer: Tokenizer, prompt_tokens: int = 128, limit: int | None = None,
                    max_prompt_len: int | None = None) -> tuple[list[Prompt], list[Skipped]]:
    """Up to `limit` prompts of at most `max_prompt_len` tokens, and the rows skipped on the way, with why."""
    prompts, skipped = [], []
    for source, row in rows:
        if limit is not None and len(prompts) >= limit:
            break
        try:
            ids = row_prompt(row, tokenizer, prompt_tokens)
        except SkipRow as e:
            skipped.append(Skipped(source, str(e)))
            continue
        except SpecdecError as e:
            raise SpecdecError(f"{source}: {e}") from None
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            skipped.append(Skipped(source, f"prompt of {len(ids)} tokens leaves no room in the context "
                                           f"(at most {max_prompt_len} with these settings)"))
            continue
        prompts.append(Prompt(ids, source))
    return prompts, skipped
