"""The engines' series on the gateway's ``/metrics``, as vLLM serves its engine's on its API
port: ``weir serve`` gives the gateway each replica's scheduler ``/metrics`` URL, read when
the gateway is scraped, each series labelled ``engine`` (the replica's index, as vLLM labels
its data-parallel engines). So a scrape of the API port alone (a vLLM ServiceMonitor, the
Gateway API Inference Extension's endpoint picker) finds the queue, the KV cache usage and
the LoRA adapters. A replica that does not answer within the timeout is left out of that
read."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from weir.shared.log_limit import limited_logger

_log = limited_logger(__name__)
TIMEOUT_S = 2.0
MIN_INTERVAL_S = 1.0


class _Families:
    """A registry's collector of families already read."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


class EngineMetrics:
    """The replicas' series, read at most once per ``min_interval`` seconds however many
    scrapes arrive: the API port is open to every client, and a flood of scrapes must not
    become a flood of work in the schedulers' processes (each render costs one of them a few
    milliseconds of the interpreter its step loop runs on). Scrapes that arrive while a read
    is under way wait for it."""

    def __init__(
        self, urls: Sequence[str], timeout: float = TIMEOUT_S, min_interval: float = MIN_INTERVAL_S
    ) -> None:
        self.urls = list(urls)
        self.timeout = timeout
        self.min_interval = min_interval
        self._families: list[Metric] = []
        self._fresh_until = float("-inf")  # time.monotonic() until which they are reused
        self._reading: asyncio.Task[list[Metric]] | None = None

    async def registry(self, own: CollectorRegistry) -> CollectorRegistry:
        """``own``'s series and the engines', as one registry to encode."""
        if not self.urls:
            return own
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families([*own.collect(), *await self._engine_families()]))
        return registry

    async def _engine_families(self) -> list[Metric]:
        if self._reading is None and time.monotonic() >= self._fresh_until:
            self._reading = asyncio.create_task(self._read_all())
        reading = self._reading
        if reading is None:
            return self._families
        try:
            return await asyncio.shield(reading)  # a scraper that leaves cancels only itself
        finally:
            if self._reading is reading and reading.done():
                self._reading = None
                self._fresh_until = time.monotonic() + self.min_interval
                if not reading.cancelled() and reading.exception() is None:
                    self._families = reading.result()

    async def _read_all(self) -> list[Metric]:
        """Every replica's families, merged by name, each sample labelled with its replica."""
        read = await asyncio.gather(*(asyncio.to_thread(self._read, url) for url in self.urls))
        merged: dict[str, Metric] = {}
        for engine, families in enumerate(read):
            for family in families:
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                into.samples += [
                    s._replace(labels={**s.labels, "engine": str(engine)}) for s in family.samples
                ]
        return list(merged.values())

    def _read(self, url: str) -> list[Metric]:
        """The families at ``url``, parsed here, off the event loop; none if it fails."""
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                body: bytes = response.read()
            return list(text_string_to_metric_families(body.decode()))
        except (OSError, ValueError) as exc:
            _log.warning("engine metrics at %s left out of this scrape: %s", url, exc)
            return []
