"""The drafter registry: the one list of kinds, specs and vLLM's --speculative-config parsed against it, and a new
kind added as docs/drafters.md says (a module and one entry) running end to end."""

import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.drafters import registry
from specdec.drafters.registry import DrafterKind, DrafterSource, from_speculative_config, parse_spec
from specdec.errors import SpecdecError


def test_every_kind_is_in_the_help_and_the_specs():
    assert registry.specs() == ["ngram", "none", "eagle3=DIR", "peagle=DIR", "model=DIR", "mtp=DIR", "ngram+eagle3=DIR",
                                "ngram+peagle=DIR", "ngram+model=DIR", "ngram+mtp=DIR"]
    help_text = registry.help_text()
    for kind in registry.KINDS.values():
        if kind.wraps:  # the composites in one entry
            assert kind.wraps in registry.KINDS and "ngram+KIND=DIR" in help_text
        else:
            assert kind.spec in help_text and kind.summary in help_text
    assert "none" not in registry.help_text(plain=False)


def test_specs_parse_or_fail_with_one_line(tmp_path):
    assert parse_spec("none") == (None, None)
    assert parse_spec("ngram") == (registry.KINDS["ngram"], None)
    assert parse_spec(f"eagle3={tmp_path}") == (registry.KINDS["eagle3"], tmp_path)
    for spec, needle in [("eagle9", "unknown drafter 'eagle9'"), ("mtp", "needs the assistant checkpoint's directory"),
                         (f"model={tmp_path / 'absent'}", "not a directory"), (f"ngram={tmp_path}", "takes no directory")]:
        with pytest.raises(SpecdecError, match=needle):
            parse_spec(spec)


@pytest.mark.parametrize("method, kind", [("eagle3", "eagle3"), ("draft_model", "model"), ("mtp", "mtp")])
def test_vllm_methods_name_our_kinds(method, kind, tmp_path):
    config = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 5}
    assert from_speculative_config(config) == (f"{kind}={tmp_path}", 5, {})


@pytest.mark.parametrize("flags, kind", [({}, "eagle3"), ({"parallel_drafting": False}, "eagle3"),
                                         ({"parallel_drafting": True}, "peagle"), ({"ngram_first": True}, "ngram+eagle3"),
                                         ({"parallel_drafting": True, "ngram_first": True}, "ngram+peagle")])
def test_parallel_drafting_and_ngram_first_pick_the_kind(flags, kind, tmp_path):
    """vLLM's parallel_drafting tells P-EAGLE from EAGLE-3; specdec's ngram_first puts n-gram lookup before either."""
    config = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 5, **flags}
    assert from_speculative_config(config) == (f"{kind}={tmp_path}", 5, {})
    config = {"method": "mtp", "model": str(tmp_path), "num_speculative_tokens": 5, "ngram_first": True,
              "prompt_lookup_min": 3}
    assert from_speculative_config(config) == (f"ngram+mtp={tmp_path}", 5, {"prompt_lookup_min": 3})
    with pytest.raises(SpecdecError, match="unknown keys \\['parallel_drafting'\\] for method 'ngram'"):
        from_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "parallel_drafting": True})


def test_ngram_options_and_plain_decoding():
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}
    assert from_speculative_config(config) == ("ngram", 4, {"prompt_lookup_max": 5})
    assert from_speculative_config({}) == from_speculative_config({"method": "none"}) == ("none", 0, {})
    source = DrafterSource("ngram", None, prompt_lookup_min=2, prompt_lookup_max=5)
    assert source.taps == () and not source.samples_drafts
    drafter = source.build(None, 4)
    assert (drafter.min_ngram, drafter.max_ngram) == (2, 5)
    with pytest.raises(SpecdecError, match="must be integers"):
        DrafterSource("ngram", None, prompt_lookup_max="5").taps
    with pytest.raises(SpecdecError, match="takes no options"):
        DrafterSource("ngram", None, temperature=1)


def test_a_new_kind_is_a_module_and_one_entry(ckpt, monkeypatch):
    """The example of docs/drafters.md: generate with it writes plain decoding's text, as every drafter must."""
    kind = DrafterKind("long-lookup", "long lookup", "prompt lookup of 4- to 8-token matches",
                       "tests.drafters.long_lookup")
    monkeypatch.setitem(registry.KINDS, kind.name, kind)
    runner = CliRunner()
    prompt = "a b c d e f a b c d e f a b c d"
    args = ["generate", prompt, "--target", str(ckpt), "--max-new-tokens", "12", "-k", "3"]
    drafted = runner.invoke(app, [*args, "--drafter", "long-lookup"])
    plain = runner.invoke(app, [*args, "--drafter", "none"])
    assert drafted.exit_code == plain.exit_code == 0, drafted.stderr + plain.stderr
    assert drafted.stdout == plain.stdout
    assert "drafter long-lookup" in drafted.stderr
    loaded = DrafterSource("long-lookup").loaded
    assert (loaded.min_ngram, loaded.max_ngram) == (4, 8)
