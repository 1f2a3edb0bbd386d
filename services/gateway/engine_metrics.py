"""The engines' series on the gateway's ``/metrics``, as vLLM serves its engine's on its API
port: ``weir serve`` gives the gateway each replica's scheduler ``/metrics`` URL, read when
the gateway is scraped, each series labelled ``engine`` (the replica's index, as vLLM labels
its data-parallel engines). So a scrape of the API port alone (a vLLM ServiceMonitor, the
Gateway API Inference Extension's endpoint picker) finds the queue, the KV cache usage and
the LoRA adapters. A replica that does not answer within the timeout is left out of that
scrape."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from weir.shared.log_limit import limited_logger

_log = limited_logger(__name__)
TIMEOUT_S = 2.0


class _Families:
    """A registry's collector of families already read."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


class EngineMetrics:
    def __init__(self, urls: Sequence[str], timeout: float = TIMEOUT_S) -> None:
        self.urls = list(urls)
        self.timeout = timeout

    async def registry(self, own: CollectorRegistry) -> CollectorRegistry:
        """``own``'s series and the engines' at this moment, as one registry to encode."""
        if not self.urls:
            return own
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
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families([*own.collect(), *merged.values()]))
        return registry

    def _read(self, url: str) -> list[Metric]:
        """The families at ``url``, parsed here, off the event loop; none if it fails."""
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                body: bytes = response.read()
            return list(text_string_to_metric_families(body.decode()))
        except (OSError, ValueError) as exc:
            _log.warning("engine metrics at %s left out of this scrape: %s", url, exc)
            return []
