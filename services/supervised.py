"""The child's side of supervision by ``weir serve`` / ``LLM`` (see ``launcher``): the status
pipe and the parent check. Both are no-ops for a process started by hand or by Kubernetes."""

from __future__ import annotations

import json
import os
from typing import Any


class StatusReporter:
    """The child's end of the status pipe (a no-op when run by hand or by Kubernetes)."""

    def __init__(self, fd: int | None) -> None:
        # The bare descriptor, which exit closes: a file object left open at exit is a
        # ResourceWarning, and no role has one place to close it.
        self._fd = fd

    def report(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        line = (json.dumps({"event": event, **fields}) + "\n").encode()
        try:
            while line:
                line = line[os.write(self._fd, line) :]
        except OSError:  # supervisor already gone; the parent watchdog handles that
            pass

    def ready(self, **fields: Any) -> None:
        self.report("ready", **fields)

    def error(self, message: str) -> None:
        self.report("error", message=message)


def parent_gone(parent_pid: int | None) -> bool:
    """True when this process was started by a supervisor that has since died."""
    return parent_pid is not None and os.getppid() != parent_pid
