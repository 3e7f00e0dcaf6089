"""Every command's numeric and path options at their edge values: zero, negative, huge (and NaN for real numbers);
missing, a file where a directory goes, a path below a file, a non-empty directory of the user's. Each run ends
either with exit 1 and one line on stderr, nothing escaping the CLI (no traceback), or with exit 0 and a correct
result; and no file changes but the command's own output.

A value a command accepts runs it. Where that would take minutes or never end (validate's gates, bench, a server,
distillation, training), the runs get a target (or data) that is absent, or validate a dtype no engine has: a value they
accept then ends at that one-line error, after every check of the options; the commands that finish in seconds
(generate's two tokens, corpus, import-gguf, export, inspect) run to their result."""

from pathlib import Path

import pytest

from specdec.cli import app
from tests.checkpoints import with_real_tokenizer
from tests.models.test_gguf_import import write_tiny_gemma3_gguf
from tests.test_bad_input import training_checkpoint  # noqa: F401 (a fixture)
from tests.test_cli import one_line_error, runner, snapshot

NUMBERS = {"zero": "0", "negative": "-1", "huge": str(10**9)}
REALS = {**NUMBERS, "nan": "nan"}
PATHS = {"missing": "absent/x", "a file": "file.txt", "below a file": "file.txt/x", "a non-empty dir": "mine"}

# command -> its arguments ({in}: the user's inputs, {out}: where it writes, {value}: where a positional argument under
# test goes, else the option is added after them), its options with their values ("": the positional argument), and
# those that name an output (a file or directory the command writes)
COMMANDS = {
    "generate": (["generate", "Hello", "--target", "{ckpt}", "--max-new-tokens", "2"],
                 {**{flag: NUMBERS for flag in ("-k", "--max-new-tokens", "--top-k", "--seed", "--max-seq-len",
                                                "--tensor-parallel", "--tp-parts")},
                  **{flag: REALS for flag in ("--temperature", "--top-p", "--min-p")}, "--target": PATHS}, ()),
    "validate": (["validate", "--target", "{ckpt}", "--dtype", "float8", "--evidence", "{out}/ev.json"],
                 {**{flag: NUMBERS for flag in ("--tokens", "--k-max", "--draws", "--sampled-rows")},
                  **{flag: PATHS for flag in ("--target", "--prompts", "--evidence")}}, ("--evidence",)),
    "bench": (["bench", "--target", "{in}/absent", "--engines", "torch", "--no-peer", "--out", "{out}/b.json"],
              {**{flag: NUMBERS for flag in ("--k-max", "--max-new-tokens", "--num-prompts", "--k")},
               **{flag: PATHS for flag in ("--prompts", "--dataset", "--out", "--plot")}}, ("--out", "--plot")),
    "serve": (["serve", "--target", "{in}/absent"],
              {flag: NUMBERS for flag in ("--port", "--max-num-seqs", "--max-model-len", "--cycles-per-call")}, ()),
    "distill": (["distill", "--target", "{in}/absent", "--prompts", "{in}/p.txt", "--out", "{out}/d"],
                {**{flag: NUMBERS for flag in ("--num-prompts", "--prompt-tokens", "--max-new-tokens", "--batch", "-k",
                                               "--max-seq-len", "--seed")},
                 **{flag: REALS for flag in ("--temperature", "--corpus-mb")},
                 **{flag: PATHS for flag in ("--prompts", "--out")}}, ("--out",)),
    "corpus": (["corpus", "--no-builtin", "--source", "{in}/texts", "--out", "{out}/c.jsonl"],
               {"--mb": REALS, "--heldout": NUMBERS, "--seed": NUMBERS, "--source": PATHS, "--out": PATHS}, ("--out",)),
    "train": (["train", "eagle3", "--data", "{in}/absent", "--out", "{out}/run"],
              {**{flag: NUMBERS for flag in ("--steps", "--batch-size", "--seq-len", "--warmup", "--ttt-steps",
                                             "--draft-vocab", "--seed", "--eval-rows", "--eval-every", "--save-every",
                                             "--keep", "--log-every", "--devices")},
               "--lr": REALS, **{flag: PATHS for flag in ("--data", "--out", "--target", "--config")}}, ("--out",)),
    "eagle3-eval": (["train", "eagle3-eval", "--head", "{in}/absent", "--data", "{in}/absent"],
                    {**{flag: NUMBERS for flag in ("--batch-size", "--seq-len", "--ttt-steps")},
                     **{flag: PATHS for flag in ("--head", "--data", "--out")}}, ("--out",)),
    "inspect": (["inspect"], {"--target": PATHS}, ()),
    "import-gguf": (["import-gguf", "{in}/tiny.gguf", "{value}"], {"": PATHS}, ("",)),
    "import-gguf's input": (["import-gguf", "{value}", "{out}/ckpt"], {"": PATHS}, ()),
    "export": (["export", "{checkpoint}", "{value}"], {"": PATHS}, ("",)),
    "export's input": (["export", "{value}", "{out}/head"], {"": PATHS}, ()),
}
# An accepted run's result, by the command's first word: its text and the last line of its report.
RESULTS = {
    "generate": lambda out, last: out.startswith("Hello") and "2 tokens at" in last,
    "corpus": lambda out, last: last.startswith("wrote 1 rows to "),
    "import-gguf": lambda out, last: last.startswith("wrote "),
    "export": lambda out, last: last.startswith("wrote "),
}
CASES = [(command, flag, kind, value) for command, (_, options, _) in COMMANDS.items()
         for flag, values in options.items() for kind, value in values.items()]
UNSEEN = object()


@pytest.fixture(scope="module")
def shared_ckpt(random_checkpoints, tmp_path_factory):
    """The `ckpt` fixture's checkpoint, written once for the module's runs (each run checks it is unchanged)."""
    return with_real_tokenizer(random_checkpoints["gemma3"], tmp_path_factory.mktemp("sweep") / "ckpt")


def stats(root):
    """Every file's size and modification time under `root`: to show a run left a large tree alone."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def files(tmp_path, shared_ckpt, training_checkpoint):  # noqa: F811
    """The user's files the runs read, beside the values' paths: a prompt file, a text source, a GGUF."""
    (tmp_path / "in" / "texts").mkdir(parents=True)
    (tmp_path / "in" / "p.txt").write_text("def add(a, b):\n")
    (tmp_path / "in" / "texts" / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    write_tiny_gemma3_gguf(tmp_path / "in" / "tiny.gguf")
    (tmp_path / "file.txt").write_text("a file of the user's")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a file of the user's")
    (tmp_path / "out").mkdir()
    return {"in": tmp_path / "in", "out": tmp_path / "out", "ckpt": shared_ckpt, "checkpoint": training_checkpoint}


@pytest.mark.parametrize("command, flag, kind, value", CASES, ids=[f"{c}:{f or 'arg'}={k}" for c, f, k, _ in CASES])
def test_an_edge_value_is_refused_in_one_line_or_runs(files, tmp_path, command, flag, kind, value):
    base, _, outputs = COMMANDS[command]
    # What the run may write: under out/; and where an output is the value, that path, files beside it named after
    # it (corpus's NAME.manifest.json) and the directories it makes to hold them.
    own = ["out"] + ([value, str(Path(value).with_suffix(""))] if flag in outputs and kind in PATHS else [])
    if kind in PATHS:
        value = str(tmp_path / value)
    args = [arg.format(value=value, **files) for arg in base]
    if "{value}" not in base:
        args += [flag, value]
    before, checkpoints = snapshot(tmp_path), (stats(files["ckpt"]), stats(files["checkpoint"]))
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    if result.exit_code:
        one_line_error(result.exit_code, result.stderr)
    else:
        assert RESULTS[command.split("'")[0]](result.stdout, result.stderr.strip().splitlines()[-1]), result.stderr
    after = snapshot(tmp_path)
    changed = {path for path in before.keys() | after.keys() if before.get(path, UNSEEN) != after.get(path, UNSEEN)}
    made_to_hold = {path for path in changed if path not in before and any(o.startswith(path + "/") for o in own)}
    assert not {path for path in changed - made_to_hold if not any(path.startswith(o) for o in own)}
    assert (stats(files["ckpt"]), stats(files["checkpoint"])) == checkpoints
