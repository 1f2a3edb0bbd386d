"""The Responses API's stored responses (``store``, OpenAI's default): each response, and
the items of its conversation (the input of the responses before it, its own input and its
output), kept in this gateway's memory, the last ``MAX_STORED_RESPONSES`` of them.
``previous_response_id`` continues a stored conversation; ``GET /v1/responses/{id}`` reads a
response back, ``DELETE`` drops it. Behind several gateways, a response is stored by the one
that answered it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1000


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response as it was returned
    conversation: list[dict[str, Any]]  # input items, its own output's last


class ResponseStore:
    """The last ``capacity`` responses stored, by id; reading one keeps it longer."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self._capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, body: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
        """Store the response ``body`` answering the conversation ``inputs``."""
        self._responses[body["id"]] = StoredResponse(body, [*inputs, *body["output"]])
        self._responses.move_to_end(body["id"])
        while len(self._responses) > self._capacity:
            self._responses.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
