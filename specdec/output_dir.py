"""Directories a command writes whole (import-gguf's checkpoint, export's head), written so that nothing the command
did not write is ever lost.

What a command wrote is recognised by name: it declares the files it writes (glob patterns), and a directory is its
own when every entry in it matches one of them: an earlier output of the command, which a new one replaces. Any other
entry (a file of another name, a subdirectory) makes the directory foreign: refused with one line before any work is
done, or, with `overwrite`, kept while the command's files around it are replaced. A path that exists and is not a
directory is always refused.

The output is built in a temporary sibling, `.NAME.TAG-PID` (PID: the writing process), then moved into place: renamed
whole where nothing was there, else file by file: the command's old files removed first, the new ones moved in in the
order of the patterns, so that a completeness marker declared last lands last. A sibling of this form whose process is
gone is the remnant of a killed run; the next run removes it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from specdec.errors import SpecdecError


class OutputDir:
    """`path`, to be written by `command` (named in errors, e.g. "import-gguf"), whose files match `writes`."""

    def __init__(self, path: str | Path, writes: Sequence[str], command: str, tag: str, overwrite: bool = False):
        self.path = Path(path)
        self.place = self.path.resolve()  # "." has no name of its own to put a sibling beside
        self.writes, self.command, self.tag, self.overwrite = tuple(writes), command, tag, overwrite
        if not self.place.name:
            raise SpecdecError(f"{self.path}: cannot be an output directory (write into a directory below it)")
        self.check()

    def ours(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.writes)

    def check(self) -> None:
        """Refuse a path that is not a directory, or a foreign directory without `overwrite` (module docstring)."""
        if self.place.exists() and not self.place.is_dir():
            raise SpecdecError(f"{self.path}: exists and is not a directory")
        above = next(parent for parent in self.place.parents if parent.exists())
        if not above.is_dir():
            raise SpecdecError(f"{self.path}: {above} is not a directory")
        if self.overwrite or not self.place.is_dir():
            return
        foreign = sorted(entry.name + "/" * entry.is_dir() for entry in self.place.iterdir()
                         if entry.is_dir() or not self.ours(entry.name))
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise SpecdecError(f"{self.path}: holds files {self.command} did not write ({shown}); give a new or empty "
                               f"directory, or --overwrite to replace only {self.command}'s files there")

    @contextmanager
    def writing(self) -> Iterator[Path]:
        """An empty directory to write the output into; moved into place when the block ends without an error."""
        staging = self.place.with_name(f".{self.place.name}.{self.tag}-{os.getpid()}")
        work = staging / self.place.name  # writers that build a directory beside their own output stay inside staging
        try:
            self.place.parent.mkdir(parents=True, exist_ok=True)
            self._remove_stale()
            work.mkdir(parents=True)
            yield work
            stray = [p.name for p in work.iterdir() if p.is_dir() or not self.ours(p.name)]
            assert not stray, f"{self.command} wrote {stray}, which its OutputDir does not declare"
            self.check()  # again: the directory may have changed while the output was built
            self._move_into_place(work)
        except OSError as e:  # a full disk, a read-only directory
            raise SpecdecError(f"{self.path}: cannot write ({e.strerror or e})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _move_into_place(self, work: Path) -> None:
        if not self.place.exists():
            os.replace(work, self.place)
            return
        for old in self.place.iterdir():
            if not old.is_dir() and self.ours(old.name):
                old.unlink()

        def order(path: Path) -> int:
            return next(i for i, pattern in enumerate(self.writes) if fnmatch.fnmatchcase(path.name, pattern))

        for new in sorted(work.iterdir(), key=order):
            os.replace(new, self.place / new.name)

    def _remove_stale(self) -> None:
        """Staging siblings of this command whose process has ended (killed mid-write)."""
        pattern = re.compile(rf"\.{re.escape(self.place.name)}\.{re.escape(self.tag)}-(\d+)")
        for sibling in self.place.parent.iterdir():
            match = pattern.fullmatch(sibling.name)
            if match and sibling.is_dir() and not _running(int(match.group(1))):
                shutil.rmtree(sibling, ignore_errors=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has not started its staging yet: one of that pid is a dead namesake's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
