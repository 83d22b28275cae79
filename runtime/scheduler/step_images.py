"""What an extend step tells the runner about its requests' images: which new tokens take
which image embeddings, and (for a model whose image tokens attend to each other) how far
each new token attends."""

from __future__ import annotations

from collections.abc import Sequence

from sprig.runtime.forward_step import StepImage
from sprig.runtime.scheduler.admission import Extend


def extend_images(extends: Sequence[Extend], bidirectional: bool) -> tuple[list[StepImage], list[int] | None]:
    """The step's `StepImage`s, and its `attend_until` (None: causal for every token, as
    when no request of the step has an image, or `bidirectional` is False). An extend
    never cuts an image (`Req.extend_length`), so the new tokens of an image see all of
    it: `attend_until` is its end for each of them, position + 1 for every other token."""
    if not any(ext.req.images for ext in extends):
        return [], None
    images: list[StepImage] = []
    until: list[int] = []
    row = 0
    for ext in extends:
        start = ext.req.kv_len
        end = start + ext.length
        own = list(range(start + 1, end + 1))
        for image in ext.req.images:
            lo, hi = max(image.offset, start), min(image.end, end)
            if lo < hi:
                images.append(StepImage(image.tensor(), row + lo - start, lo - image.offset, hi - lo))
                own[lo - start : hi - start] = [image.end] * (hi - lo)
        until.extend(own)
        row += ext.length
    return images, until if images and bidirectional else None
