"""The Responses API's stored responses (``store``, OpenAI's default): each response with
the items it added to its conversation (its input's and its output's) and the response it
continued, kept in this gateway's memory: the last ``MAX_STORED_RESPONSES`` of them, at most
``MAX_STORED_BYTES`` of JSON together. ``previous_response_id`` continues a stored
conversation (walked back through the responses it continued); ``GET /v1/responses/{id}``
reads a response back, ``DELETE`` drops it. Behind several gateways, a response is stored by
the one that answered it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1000
MAX_STORED_BYTES = 256 * 2**20


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response as it was returned
    items: list[dict[str, Any]]  # the input items it was asked with, then its output's
    previous: str | None  # the response it continued
    size: int  # bytes of the two as JSON


class ResponseStore:
    """The last responses stored, by id; reading one (or one that continues it) keeps it
    longer. Each holds its own items only, so a long conversation is stored once."""

    def __init__(
        self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self._capacity, self._max_bytes = capacity, max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items of the conversation a response ends (its own last); None if it, or a
        response before it, is no longer stored."""
        chain: list[str] = []
        at: str | None = response_id
        while at is not None:
            stored = self._responses.get(at)
            if stored is None:
                return None
            chain.append(at)
            at = stored.previous
        for at in reversed(chain):  # kept longer, the later ones longest
            self._responses.move_to_end(at)
        return [item for at in reversed(chain) for item in self._responses[at].items]

    def put(self, body: dict[str, Any], inputs: list[dict[str, Any]], previous: str | None) -> None:
        """Store the response ``body``, asked with ``inputs`` after response ``previous``."""
        items = [*inputs, *body["output"]]
        size = len(json.dumps(body)) + len(json.dumps(items))
        self.delete(body["id"])
        self._responses[body["id"]] = StoredResponse(body, items, previous, size)
        self._bytes += size
        while self._responses and (
            len(self._responses) > self._capacity or self._bytes > self._max_bytes
        ):
            self._bytes -= self._responses.popitem(last=False)[1].size

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored is not None
