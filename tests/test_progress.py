"""Progress bars in logs: on a console that is no terminal, LoggedProgress prints a line per step."""

import io

from rich.console import Console
from rich.progress import TextColumn

from specdec.progress import LoggedProgress


def lines(out: io.StringIO) -> list[str]:
    return [line for line in out.getvalue().splitlines() if line]  # rich ends a stopped display with a newline


def bar(terminal: bool, every: float = 30.0) -> tuple[LoggedProgress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=100)
    return LoggedProgress(TextColumn("{task.description}"), console=console, transient=True, every=every), out


def test_a_log_gets_a_line_for_each_new_description_and_not_for_each_advance():
    progress, out = bar(terminal=False)
    with progress:
        task = progress.add_task("loading", total=3)
        progress.update(task, description="prompt 1/2 · K=0")
        progress.advance(task)
        progress.advance(task)  # same description within `every` seconds: no line
        progress.update(task, description="prompt 2/2 · K=0")
        progress.advance(task)
    assert lines(out) == ["[0:00] loading (0/3)", "[0:00] prompt 1/2 · K=0 (0/3)", "[0:00] prompt 2/2 · K=0 (2/3)"]


def test_a_log_gets_the_count_again_once_every_seconds_have_passed():
    progress, out = bar(terminal=False, every=0.0)
    with progress:
        task = progress.add_task("distilling", total=2)
        progress.advance(task)
        progress.advance(task)
    assert lines(out) == ["[0:00] distilling (0/2)", "[0:00] distilling (1/2)",
                                           "[0:00] distilling (2/2)"]


def test_a_terminal_gets_rich_s_bar_and_no_lines():
    progress, out = bar(terminal=True)
    with progress:
        task = progress.add_task("loading", total=1)
        progress.update(task, description="prompt 1/1")
    assert "(0/1)" not in out.getvalue()
