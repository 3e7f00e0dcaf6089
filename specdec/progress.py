"""Progress bars that also show in logs.

rich's Progress draws a live bar on a terminal. Where the console is no terminal (output to a file, CI, a remote
command), it draws nothing until it stops, and nothing at all if transient: `specdec validate` on a GPU ran for
9 minutes without a line. LoggedProgress prints a line there instead, for each new description and at least every
`every` seconds while the count moves.
"""

from __future__ import annotations

import time

from rich.progress import Progress, TaskID


class LoggedProgress(Progress):
    """rich's Progress; on a console that is no terminal, a line per step (module docstring)."""

    def __init__(self, *columns, every: float = 30.0, **kwargs):
        super().__init__(*columns, **kwargs)
        self.every = every
        self._last_line: dict[TaskID, tuple[str, float]] = {}  # task -> (description, monotonic time) last printed

    def add_task(self, description: str, *args, **kwargs) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self._print_line(task_id)
        return task_id

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._print_line(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._print_line(task_id)

    def _print_line(self, task_id: TaskID) -> None:
        if self.disable or self.console.is_terminal:
            return
        task = self._tasks[task_id]
        now = time.monotonic()
        last = self._last_line.get(task_id)
        if last is not None and last[0] == task.description and now - last[1] < self.every:
            return
        self._last_line[task_id] = (task.description, now)
        minutes, seconds = divmod(int(task.elapsed or 0), 60)
        count = f"{task.completed:g}" + (f"/{task.total:g}" if task.total is not None else "")
        self.console.print(f"[{minutes}:{seconds:02d}] {task.description} ({count})", highlight=False, markup=False,
                           soft_wrap=True)
