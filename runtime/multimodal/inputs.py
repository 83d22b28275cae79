"""A prompt's images as they cross to the scheduler, and how the radix tree keys them.

An image becomes `ImageSpec.tokens_per_image` placeholder tokens in the prompt, whose
embeddings the model's image encoder supplies. Their token ids are all the same, so the
radix tree cannot tell two images apart by them: it keys the placeholders of an image by
its pixels' digest instead (`image_keys`), and a cached prefix ending inside an image is
reused only when enough of its keys matched to make a collision negligible
(`MIN_MATCHED_KEYS`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from sprig.runtime import wire

# An image's placeholders are keyed from IMAGE_KEY_BASE up (below the radix tree's namespace
# bits: sprig.radix.tree.NAMESPACE_SHIFT is 24), so no token id of a served model (checked
# against its vocabulary) can equal one: 23 bits of the digest per key.
IMAGE_KEY_BASE = 1 << 23
_KEY_BITS = 23
# why a text-only model refuses a request with images
TEXT_ONLY = "this model takes no images (it is not a vision-language model)"
# keys of one image that must match before a cached prefix ending inside it is reused:
# 8 keys carry 184 bits of its digest (all of an image's keys when it has fewer)
MIN_MATCHED_KEYS = 8


@dataclass(frozen=True)
class ImageInput:
    """One processed image of a prompt: `pixels`, the float32 bytes (C order) of a tensor
    of `shape` (the image processor's output for one image, `[C, H, W]`); `digest`, the
    sha256 of shape and bytes; `offset`, the index in the prompt of the first of its
    placeholder tokens (`length` of them, all the model's image token)."""

    pixels: bytes
    shape: tuple[int, ...]
    digest: bytes
    offset: int
    length: int

    @classmethod
    def of(cls, pixels: torch.Tensor, offset: int, length: int) -> ImageInput:
        """From the processor's float32 `[C, H, W]` pixel values of one image."""
        array = pixels.detach().to("cpu", torch.float32).contiguous().numpy()
        data = array.tobytes()
        digest = hashlib.sha256(repr(array.shape).encode() + data).digest()
        return cls(data, tuple(array.shape), digest, offset, length)

    @property
    def end(self) -> int:
        """The index just past its last placeholder."""
        return self.offset + self.length

    def tensor(self) -> torch.Tensor:
        """Its pixel values, float32 `shape`, on the CPU (a copy)."""
        return torch.from_numpy(np.frombuffer(self.pixels, dtype=np.float32).copy()).view(self.shape)

    def keys(self) -> list[int]:
        """How the radix tree keys its placeholders: key j is 23 bits of the digest (the
        digest's eight 32-bit words in turn, each shifted by j's round), from
        `IMAGE_KEY_BASE` up."""
        words = [int.from_bytes(self.digest[4 * i : 4 * i + 4], "little") for i in range(8)]
        mask = (1 << _KEY_BITS) - 1
        return [IMAGE_KEY_BASE + ((words[j % 8] >> (j // 8 % 9)) & mask) for j in range(self.length)]


def keyed(ids: list[int], images: tuple[ImageInput, ...]) -> list[int]:
    """`ids` (a prefix of the prompt and output, or all of it) with each image's
    placeholders replaced by its keys (`ImageInput.keys`)."""
    if not images:
        return ids
    out = list(ids)
    for image in images:
        if image.offset >= len(out):
            break
        keys = image.keys()
        end = min(image.end, len(out))
        out[image.offset : end] = keys[: end - image.offset]
    return out


def reusable_prefix(matched: int, images: tuple[ImageInput, ...]) -> int:
    """The longest part of a `matched` cached prefix to reuse: all of it, unless it ends
    inside an image after fewer than `MIN_MATCHED_KEYS` of its keys (then up to that
    image's start)."""
    for image in images:
        if image.offset < matched < image.end and matched - image.offset < min(MIN_MATCHED_KEYS, image.length):
            return image.offset
    return matched


wire.register(ImageInput, tuples=frozenset({"shape"}))
