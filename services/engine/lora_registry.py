"""The LoRA adapters a server serves: those it started with (``--lora-modules``) and those
loaded or unloaded at runtime (``--allow-runtime-lora-updating``, vLLM's
``/v1/load_lora_adapter``).

A request names an adapter; the scheduler and the executors know it by its adapter id:
the name for an adapter the server started with, ``name#N`` for the N-th one loaded at
runtime. A name unloaded and loaded again, perhaps from new weights, gets a new id, so
the KV blocks cached under the old one (the prefix cache keys them by id) are never read
for the new one. ``#`` is not allowed in names, so ids never collide with them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from weir.shared.lora import LoraModule, check_name


class AdapterNotFound(LookupError):
    """A request names an adapter the server does not serve (the API's 404)."""


RUNTIME_UPDATES_OFF = (
    "this server loads and unloads no LoRA adapters at runtime: start it with "
    "--allow-runtime-lora-updating"
)


class LoraRegistry:
    """``ids``: name -> adapter id; ``adapters``: adapter id -> [directory, fingerprint of
    its files], what executors hold. ``check`` reads an adapter's files and returns their
    fingerprint, or raises ValueError for one the executors cannot load (None: the adapters
    are fixed at start-up)."""

    def __init__(
        self,
        modules: dict[LoraModule, str],
        model_names: tuple[str, ...],
        check: Callable[[str], str] | None = None,
    ) -> None:
        for module in modules:
            if module.name in model_names:
                raise ValueError(
                    f"lora_modules: adapter name {module.name!r} is the served model's name: "
                    "requests for it would not know which they mean"
                )
        self.ids = {m.name: m.name for m in modules}
        self.adapters = {m.name: [m.path, fingerprint] for m, fingerprint in modules.items()}
        self.model_names = model_names
        self.unloading: set[str] = set()  # names that take no new request: they drain
        self._check = check
        self._loads = itertools.count(1)

    @property
    def runtime_updates(self) -> bool:
        return self._check is not None

    def check_load(self, name: str) -> None:
        """Whether an adapter may be loaded as ``name``, told before its files are read
        (ValueError)."""
        if self._check is None:
            raise ValueError(RUNTIME_UPDATES_OFF)
        check_name(name, "lora_name")
        if name in self.model_names:
            raise ValueError(f"lora_name {name!r} is the served model's name")
        if name in self.ids:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded: unload it first")

    def read(self, path: str) -> str:
        """The adapter's files checked, and their fingerprint (slow: a worker thread's job)."""
        assert self._check is not None
        return self._check(path)

    def add(self, name: str, path: str, fingerprint: str) -> None:
        self.check_load(name)  # again: another load of the name may have come first
        adapter_id = f"{name}#{next(self._loads)}"
        self.ids[name] = adapter_id
        self.adapters[adapter_id] = [path, fingerprint]

    def start_unload(self, name: str) -> str:
        """Take no new request of ``name`` (its requests in flight end first); its id.
        AdapterNotFound when no adapter has the name."""
        if self._check is None:
            raise ValueError(RUNTIME_UPDATES_OFF)
        adapter_id = self.ids.get(name)
        if adapter_id is None:
            raise AdapterNotFound(f"the LoRA adapter {name!r} is not loaded")
        if name in self.unloading:
            raise ValueError(f"the LoRA adapter {name!r} is being unloaded already")
        self.unloading.add(name)
        return adapter_id

    def finish_unload(self, name: str) -> None:
        self.unloading.discard(name)
        del self.adapters[self.ids.pop(name)]

    def cancel_unload(self, name: str) -> None:
        self.unloading.discard(name)
