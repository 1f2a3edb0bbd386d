"""Weir's processes (scheduler, executor, launcher, CLI) and the offline ``LLM`` API.

``LLM`` and ``Completion`` are loaded on first use, so importing ``weir.services``
stays cheap (no torch, no sockets).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weir.services.llm import LLM, Completion

__all__ = ["LLM", "Completion"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weir.services import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'weir.services' has no attribute {name!r}")
