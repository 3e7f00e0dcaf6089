"""Prompt sources: row layouts (text, prompt, ShareGPT and OpenAI conversations), skips with their reasons,
JSONL and local datasets, and nothing fetched from the hub."""

import json
import shutil

import pytest

from specdec.data.sources import collect_prompts, dataset_rows, jsonl_rows, row_prompt
from specdec.errors import SpecdecError
from specdec.models.gguf_import import default_checkpoint
from specdec.models.tokenizer import Tokenizer

# Gemma's turn markup; like Gemma's template it wants "model" for the assistant.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{% if role not in ['user', 'model'] %}{{ raise_exception('roles must be user or model') }}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40))


def tokenizer(directory, template=None) -> Tokenizer:
    """The real Gemma 3 tokenizer (a base model: no chat template), with `template` added if given."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_checkpoint() / name, directory / name)
    if template:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tokenizer(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return tokenizer(tmp_path_factory.mktemp("chat"), TEMPLATE)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_is_cut_at_a_line_boundary(tok):
    ids = row_prompt({"text": CODE}, tok, prompt_tokens=50)
    prompt = tok.decode(ids[1:])
    assert ids[0] == tok.bos_id and 25 <= len(ids) - 1 <= 50
    assert CODE.startswith(prompt) and prompt.endswith("\n") and len(prompt) < len(CODE)


def test_text_without_newlines_is_cut_between_words(tok):
    text = " ".join(f"word{i}" for i in range(200))
    prompt = tok.decode(row_prompt({"text": text}, tok, prompt_tokens=40)[1:])
    assert text.startswith(prompt) and prompt.endswith(" ")


def test_short_text_and_prompt_rows_are_used_whole(tok):
    assert row_prompt({"text": "def add(a, b):"}, tok, 128) == tok.encode("def add(a, b):")
    assert row_prompt({"prompt": CODE}, tok, 8) == tok.encode(CODE)  # a prompt is never cut


def test_conversations_need_a_chat_template(tok):
    rows = [("chats.jsonl:1", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}),
            ("chats.jsonl:2", {"text": "   "})]
    prompts, skipped = collect_prompts(rows, tok, 128)
    assert prompts == []
    assert [(s.source, s.reason) for s in skipped] == [
        ("chats.jsonl:1", "a conversation, and the target has no chat template"), ("chats.jsonl:2", "empty prompt")]


def test_conversation_prompt_stops_before_the_final_assistant_turn(chat_tok):
    tok = chat_tok
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                  {"from": "human", "value": "More?"}, {"from": "gpt", "value": "FINAL ANSWER"}]}
    openai = {"messages": [{"role": ("user", "assistant")[i % 2], "content": turn["value"]}
                           for i, turn in enumerate(sharegpt["conversations"])]}
    ids = row_prompt(sharegpt, tok, 128)
    assert tok.decode(ids) == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                               "<start_of_turn>user\nMore?<end_of_turn>\n<start_of_turn>model\n")
    assert ids.count(tok.bos_id) == 1
    assert row_prompt(openai, tok, 128) == ids
    # A conversation that ends on the user's turn is the prompt whole.
    assert row_prompt({"messages": openai["messages"][:3]}, tok, 128) == ids


def test_unrenderable_conversations_are_skipped_with_why(chat_tok):
    tok = chat_tok
    rows = [("a:1", {"conversations": [{"from": "robot", "value": "beep"}]}),
            ("a:2", {"messages": [{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "ok"}]}),
            ("a:3", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})]
    prompts, skipped = collect_prompts(rows, tok, 128)
    assert prompts == []
    assert skipped[0].reason == "unknown role 'robot'"
    assert skipped[1].reason == "unknown role 'tool'"
    assert "roles must be user or model" in skipped[2].reason  # the template's own refusal


def test_limit_and_context(tok):
    rows = [(f"p:{i}", {"prompt": "word " * n}) for i, n in enumerate([3, 300, 4, 5, 6])]
    prompts, skipped = collect_prompts(rows, tok, 128, limit=3, max_prompt_len=100)
    assert [p.source for p in prompts] == ["p:0", "p:2", "p:3"]
    assert [s.source for s in skipped] == ["p:1"] and "context" in skipped[0].reason
    assert all(p.ids == tok.encode(rows[int(p.source[2:])][1]["prompt"]) for p in prompts)


def test_unknown_layout_is_an_error_naming_the_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "ok"}, {"question": "?", "answer": "!"}])
    with pytest.raises(SpecdecError, match=r"rows.jsonl:2: no prompt field \(fields: question, answer"):
        collect_prompts(jsonl_rows(path), tok, 128)


def test_bad_jsonl_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "ok"}\n\n[1, 2]\n')
    with pytest.raises(SpecdecError, match="rows.jsonl:3: not a JSON object"):
        list(jsonl_rows(path))
    with pytest.raises(SpecdecError, match="cannot read prompts"):
        list(jsonl_rows(tmp_path / "missing.jsonl"))


def test_local_datasets(tmp_path):
    import datasets

    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chats),
                          "test": datasets.Dataset.from_list([{"text": "held out"}])}).save_to_disk(str(saved))
    assert [row["messages"][0]["content"] for _, row in dataset_rows(str(saved))] == ["q0", "q1", "q2"]
    assert [label for label, _ in dataset_rows(str(saved), "test")] == [f"{saved}[test]:0"]
    with pytest.raises(SpecdecError, match="no split 'dev'"):
        list(dataset_rows(str(saved), "dev"))

    datasets.Dataset.from_list([{"text": "x"}, {"text": "y"}]).to_parquet(str(tmp_path / "rows.parquet"))
    assert [row["text"] for _, row in dataset_rows(str(tmp_path / "rows.parquet"))] == ["x", "y"]
    jsonl = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p"}])
    assert [row for _, row in dataset_rows(str(jsonl))] == [{"prompt": "p"}]

    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(SpecdecError, match="without splits"):
        list(dataset_rows(str(tmp_path / "single"), "train"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(SpecdecError, match="broken.parquet: cannot load the dataset"):
        list(dataset_rows(str(tmp_path / "broken.parquet")))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SpecdecError, match="unknown data file type"):
        list(dataset_rows(str(tmp_path / "notes.txt")))


def test_dataset_names_are_never_downloaded():
    with pytest.raises(SpecdecError, match="nothing is downloaded"):
        list(dataset_rows("specdec-tests/no-such-dataset"))
