"""The event loop the serving processes run on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's loop where uvloop is installed: its loop, handles
    and socket transports are compiled (~10% of the gateway's CPU per streamed token,
    ``benchmarks/gateway_stream.py``). uvicorn picks uvloop only for a loop it creates
    itself, which ``weir gateway`` does not."""
    try:
        import uvloop
    except ImportError:  # not built for this platform
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
