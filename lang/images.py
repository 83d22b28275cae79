"""The images of a program: what `sgl.image(...)` records, and how backends send it.

As in SGLang's frontend, an image file is read here, in the program's process, and sent
as the base64 of its bytes; a URL (`http://`, `https://`, `data:`) is sent as it is, for
the server to load. The prompt text holds the chat template's `image_token` where each
image stands.
"""

from __future__ import annotations

import base64
import mimetypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

URL_SCHEMES = ("http://", "https://", "data:")
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


@dataclass(frozen=True)
class ImageData:
    """One image as backends send it.

    Invariant: `data` is either a URL as the program gave it (starts with one of
    `URL_SCHEMES`; `mime` is None) or the base64 of the image file's bytes, whose media
    type is `mime`.
    """

    data: str
    mime: str | None = None

    @property
    def url(self) -> str:
        """The image as a URL (OpenAI's `image_url.url`): `data` itself or a data URL."""
        return self.data if self.mime is None else f"data:{self.mime};base64,{self.data}"


def encode_image(source: str | bytes) -> ImageData:
    """`source` (a file path, a URL, or the image file's bytes) as an `ImageData`.

    Raises FileNotFoundError for a path that names no file and ValueError for an empty one."""
    if isinstance(source, bytes):
        return _from_bytes(source, None)
    if source.startswith(URL_SCHEMES):
        return ImageData(source)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"sgl.image: no image file {source!r} (a URL must start with http://, https:// or data:)"
        ) from None
    return _from_bytes(data, source)


def _from_bytes(data: bytes, path: str | None) -> ImageData:
    if not data:
        raise ValueError(f"sgl.image: {'the image' if path is None else repr(path)} is empty")
    return ImageData(base64.b64encode(data).decode("ascii"), _media_type(data, path))


def _media_type(data: bytes, path: str | None) -> str:
    """The media type of an image file: from its first bytes, else its name's extension."""
    for signature, mime in _SIGNATURES:
        if data.startswith(signature):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    guessed = mimetypes.guess_type(path)[0] if path is not None else None
    return guessed if guessed is not None and guessed.startswith("image/") else "application/octet-stream"


def content_parts(text: str, start: int, images: Sequence[tuple[int, int, ImageData]]) -> list[dict[str, Any]]:
    """The OpenAI content parts of `text[start:]`, whose images' tokens span
    `text[begin:end]` for each `(begin, end, image)` in order: the text around the tokens
    as text parts (empty ones left out), each token replaced by its image's `image_url`
    part."""
    parts: list[dict[str, Any]] = []
    cursor = start
    for begin, end, image in images:
        if begin > cursor:
            parts.append({"type": "text", "text": text[cursor:begin]})
        parts.append({"type": "image_url", "image_url": {"url": image.url}})
        cursor = max(cursor, end)
    if cursor < len(text):
        parts.append({"type": "text", "text": text[cursor:]})
    return parts
