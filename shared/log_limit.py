"""A log filter for lines an outsider can cause at will (a malformed frame, a refused
hello, a bad HTTP request): each kind of line at most once a second, so a flood of them
cannot flood the log (one peer wrote 4.5 MB of refusals in 3 s)."""

from __future__ import annotations

import logging
import time


class OncePerInterval(logging.Filter):
    """Lets each message template through at most once per ``interval`` seconds; the next
    line let through says how many were held back meanwhile."""

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, object], tuple[float, int]] = {}  # -> (time, held back)
        # Templates are few, but a library may log preformatted text: bound what is kept.
        self._max_kinds = 1024

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)  # the template: its arguments vary per line
        now = time.monotonic()
        last, held = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval:
            self._last[key] = (last, held + 1)
            return False
        if len(self._last) >= self._max_kinds:
            self._last.clear()
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} more such line(s) held back)"
            record.args = None
        return True


def limited_logger(name: str) -> logging.Logger:
    """The logger ``name`` with a ``OncePerInterval`` filter (added once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, OncePerInterval) for f in logger.filters):
        logger.addFilter(OncePerInterval())
    return logger
