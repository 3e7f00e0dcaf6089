"""Work in a process of its own, so that no engine runs beside another's memory, threads and compiled programs (JAX's
cycle on the 270M took 0.700 ms after torch's runs in one process, against 0.603-0.610 alone: docs/journal). The
child says what it does as lines on its stdout, each LINE and a JSON object: progress of any shape, and last
{"result": ...}; its other output and its errors reach the parent's stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

LINE = "specdec-bench "


def say(message: dict) -> None:
    """In the child: one message to the parent."""
    print(LINE + json.dumps(message), flush=True)


def run_child(command: list[str], env: dict | None = None,
              on_message: Callable[[dict], None] = lambda message: None) -> tuple[int, object]:
    """Run `command` (python -m MODULE ..., under a launcher such as torchrun if need be) -> (its exit status, the
    result it said, None if it said none). Its other messages go to `on_message` as they come."""
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    result = None
    for line in child.stdout:
        if not line.startswith(LINE):
            sys.stderr.write(line)
            continue
        message = json.loads(line[len(LINE):])
        if "result" in message:
            result = message["result"]
        else:
            on_message(message)
    return child.wait(), result
