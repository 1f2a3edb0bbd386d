"""The images of an executor's requests, and the features a step's tokens take from them.

A request's image tokens (``ModelConfig.image_token_id`` in its prompt) stand, in order,
for its images' features: the first image's tiles' rows, then the next image's. A step
that computes some of them decodes the image they belong to and runs the vision tower on
it once; the features wait for the request's later chunks, and are dropped once its
computed tokens pass the image (a request computed again after a preemption runs the
tower again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from weir.services.executor.vision_towers import Tower
from weir.shared.image_processors import ImageProcessor
from weir.shared.images import image_size, read_image
from weir.shared.protocol.step import StepPlan


@dataclass(slots=True)
class ImageEmbeds:
    """What a forward pass takes in place of some tokens' embeddings: ``features[i]`` is
    flat token ``rows[i]``'s."""

    rows: torch.Tensor  # [N] int64, on the model's device
    features: torch.Tensor  # [N, hidden] in the model's dtype


@dataclass(slots=True)
class _RequestImages:
    images: list[bytes]
    positions: np.ndarray  # [N] the prompt positions of its image tokens, ascending
    ends: list[int]  # [images + 1]: image k's tokens are positions[ends[k]:ends[k + 1]]
    last: int  # its last image token's position
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # image k's, while needed


class ImageInputs:
    def __init__(self, processing: ImageProcessor, image_token_id: int) -> None:
        self.processing = processing
        self.image_token_id = image_token_id
        self.requests: dict[str, _RequestImages] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], images: list[bytes]) -> None:
        """Hold a new request's images; ValueError where its image tokens are not theirs
        (the scheduler's front end expands each image as this executor reads it)."""
        positions = np.flatnonzero(np.asarray(prompt_token_ids) == self.image_token_id)
        ends = [0]
        for image in images:
            ends.append(ends[-1] + self.processing.num_image_tokens(*image_size(image)))
        if ends[-1] != len(positions):
            raise ValueError(
                f"request {request_id!r}: its {len(images)} images take {ends[-1]} image "
                f"tokens but its prompt holds {len(positions)}"
            )
        self.requests[request_id] = _RequestImages(images, positions, ends, int(positions[-1]))

    def apply_plan(self, plan: StepPlan) -> None:
        """Forget the requests a plan finishes; hold the images of those it sends new."""
        for request_id in plan.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            if new.images:
                self.add(new.request_id, new.prompt_token_ids, new.images)

    def clear(self) -> None:
        self.requests.clear()

    def embeds(
        self,
        tower: Tower,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        positions: np.ndarray,
    ) -> ImageEmbeds | None:
        """The image features ``tower`` makes of a step's tokens (``positions``, flat, each
        request's in its ``query_start_loc`` span); None where none is an image token."""
        rows: list[np.ndarray] = []
        features: list[torch.Tensor] = []
        for i, request_id in enumerate(req_ids):
            held = self.requests.get(request_id)
            if held is None:
                continue
            start, stop = int(query_start_loc[i]), int(query_start_loc[i + 1])
            first = int(positions[start])
            if first > held.last:  # past its images (a decode): nothing to search
                continue
            lo, hi = np.searchsorted(held.positions, (first, int(positions[stop - 1]) + 1))
            for k, (begin, end) in enumerate(zip(held.ends, held.ends[1:], strict=False)):
                if begin >= hi or end <= lo:
                    continue
                take = slice(max(lo, begin), min(hi, end))
                image = self._features(tower, held, k)
                features.append(image[take.start - begin : take.stop - begin])
                rows.append(start + held.positions[take] - first)
                if take.stop == end:  # its last token: no later chunk reads it
                    del held.features[k]
        if not rows:
            return None
        return ImageEmbeds(
            torch.from_numpy(np.concatenate(rows)).to(features[0].device), torch.cat(features)
        )

    def _features(self, tower: Tower, held: _RequestImages, k: int) -> torch.Tensor:
        """Image ``k``'s features, one row per token, computed on first use."""
        if k not in held.features:
            tiles = torch.from_numpy(self.processing.pixel_values(read_image(held.images[k])))
            weight = next(tower.parameters())
            out = tower(tiles.to(weight.device, weight.dtype))
            held.features[k] = out.reshape(-1, out.shape[-1])
        return held.features[k]
