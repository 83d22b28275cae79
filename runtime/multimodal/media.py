"""Loading one image from what a client sends, within limits.

`load_image(source, limits)` takes the forms of SGLang's `/generate` `image_data` and of
the OpenAI chat API's `image_url.url`:

- raw bytes (the encoded file);
- a data URL, `data:image/<type>;base64,<data>`;
- a bare base64 string (only the standard alphabet, `=` padding, no line breaks);
- an `http://` or `https://` URL, fetched with urllib when `MediaLimits.allow_http`;
- a `file://` URL or a plain local path, read only when `MediaLimits.allowed_local_dir`
  is set and the path, symlinks resolved, lies inside it (a relative path is taken
  relative to that directory). A string that is none of the above is taken as a path.

Checks run cheapest first, so that no refused input costs more than its limit: the
encoded size (a base64 string's length before it is decoded, a fetched body while it
streams in, a file's size before it is read), then the size in the image header (before
any pixel data is decoded; PIL's own decompression-bomb limit, `PIL.Image.MAX_IMAGE_PIXELS`,
applies too, read when an image is loaded), then the full decode.

Every refusal is a `MediaError` saying what was wrong and which limit it broke; it names
nothing but what the client sent (no server paths, no tracebacks).

The result is fully decoded and in mode RGB. Transparency is composited onto white, as
transformers' `convert_to_rgb` does for image processors with `do_convert_rgb` (Gemma 3's
among them), so a processor given the result computes the pixels it would have from the
original. An animated image gives its first frame.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import math
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

# What PIL may decode: the common image formats. Others are refused (EPS, for one, runs
# Ghostscript on load).
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
LOCAL_MEDIA_FLAG = "--allowed-local-media-path"
_READ_CHUNK = 64 * 1024
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_SHOWN = 120  # characters of a client's URL or path quoted back in a message


@dataclass(frozen=True)
class MediaLimits:
    """What `load_image` accepts.

    Invariants: `max_bytes` (an image's encoded size), `max_pixels` (its decoded width
    times height) and `fetch_timeout_s` are positive; `allowed_local_dir` is None (local
    paths refused) or an existing directory, stored absolute with its symlinks resolved.
    `fetch_timeout_s` bounds each network wait of a fetch and the whole fetch, the latter
    checked between reads.
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000
    allowed_local_dir: Path | None = None
    allow_http: bool = True
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MediaLimits.{name} must be positive; got {getattr(self, name)!r}")
        if self.allowed_local_dir is not None:
            root = Path(self.allowed_local_dir).resolve()
            if not root.is_dir():
                raise ValueError(f"{LOCAL_MEDIA_FLAG}: {self.allowed_local_dir} is not a directory")
            object.__setattr__(self, "allowed_local_dir", root)


class MediaError(ValueError):
    """An image a client sent cannot be used; the message says why, for the client."""


def load_image(source: str | bytes, limits: MediaLimits) -> Image.Image:
    """The image `source` holds or names (see the module docstring), decoded, in RGB.

    Raises `MediaError` for anything refused or unreadable; reads no more than
    `limits.max_bytes + 1` bytes of any source."""
    data, what = _read(source, limits)
    return _decode(data, what, limits)


# ---------------------------------------------------------------------- the bytes
def _read(source: Any, limits: MediaLimits) -> tuple[bytes, str]:
    """The encoded image and how to name it in a message."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_bytes(len(data), "the image bytes", limits)
        return data, "the image bytes"
    if not isinstance(source, str):
        raise MediaError(f"an image is a URL, a data URL, a base64 string or bytes, not {type(source).__name__}")
    text = source.strip()
    scheme = text[:8].lower()
    if not text:
        raise MediaError("the image is an empty string")
    if scheme.startswith("data:"):
        return _from_data_url(text, limits), "the data URL's image"
    if scheme.startswith(("http://", "https://")):
        return _fetch(text, limits)
    if scheme.startswith("file://"):
        return _read_local(text, _file_url_path(text), limits)
    if len(text) > _encoded_limit(limits) or (_BASE64.fullmatch(text) and not _looks_like_path(text)):
        return _from_base64(text, "the base64 image", limits), "the base64 image"
    return _read_local(text, Path(text), limits)


def _looks_like_path(text: str) -> bool:
    """A string of base64 characters that is a path rather than base64: it starts like one
    (`/`, `./`, `../`) and its length is no multiple of 4 (padded base64's always is; a
    JPEG's base64 starts with `/9j/`)."""
    return text.startswith(("/", "./", "../")) and len(text) % 4 != 0


def _encoded_limit(limits: MediaLimits) -> int:
    """The longest base64 text of at most `max_bytes` bytes."""
    return 4 * math.ceil(limits.max_bytes / 3)


def _refuse_size(size: int, what: str, limits: MediaLimits, about: bool = True) -> None:
    amount = f"about {size}" if about else str(size)
    raise MediaError(f"{what} is {amount} bytes, over this server's limit of {limits.max_bytes} bytes per image")


def _check_bytes(size: int, what: str, limits: MediaLimits) -> None:
    if size > limits.max_bytes:
        _refuse_size(size, what, limits, about=False)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _from_base64(text: str, what: str, limits: MediaLimits) -> bytes:
    if len(text) > _encoded_limit(limits):
        _refuse_size(len(text) * 3 // 4, what, limits)
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise MediaError(f"{what} is not valid base64: {e}") from None
    _check_bytes(len(data), what, limits)
    return data


def _from_data_url(text: str, limits: MediaLimits) -> bytes:
    header, comma, payload = text.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise MediaError("a data URL must be base64: data:image/<type>;base64,<data>")
    return _from_base64(payload.strip(), "the data URL's image", limits)


# ---------------------------------------------------------------------- http(s)
def _fetch(url: str, limits: MediaLimits) -> tuple[bytes, str]:
    if not limits.allow_http:
        raise MediaError("this server does not fetch images from URLs; send the image's bytes as base64 "
                         "or a data URL")
    shown = _shown(url)
    deadline = time.monotonic() + limits.fetch_timeout_s
    request = urllib.request.Request(url, headers={"Accept": "image/*", "User-Agent": "sprig"})
    try:
        with urllib.request.urlopen(request, timeout=limits.fetch_timeout_s) as response:
            return _read_response(response, shown, deadline, limits)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError(f"fetching {shown} failed: HTTP {e.code}; an image needs 200") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _timed_out(shown, limits) from None
        raise MediaError(f"fetching {shown} failed: {e.reason}") from None
    except TimeoutError:
        raise _timed_out(shown, limits) from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise MediaError(f"fetching {shown} failed: {type(e).__name__}") from None


def _timed_out(shown: str, limits: MediaLimits) -> MediaError:
    return MediaError(f"fetching {shown} took longer than this server's limit of {limits.fetch_timeout_s:g} s")


def _read_response(response: Any, shown: str, deadline: float, limits: MediaLimits) -> tuple[bytes, str]:
    """The body of a 200 answer, refused as soon as it passes `max_bytes` or the deadline."""
    if response.status != 200:
        raise MediaError(f"fetching {shown} answered HTTP {response.status}; an image needs 200")
    what = f"the body of {shown} (Content-Type: {response.headers.get('Content-Type', 'none')})"
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit():
        _check_bytes(int(declared), what, limits)
    chunks, size = [], 0
    while chunk := response.read1(_READ_CHUNK):
        size += len(chunk)
        if size > limits.max_bytes:
            raise MediaError(f"{what} is over this server's limit of {limits.max_bytes} bytes per image")
        if time.monotonic() > deadline:
            raise _timed_out(shown, limits)
        chunks.append(chunk)
    return b"".join(chunks), what


# ---------------------------------------------------------------------- local files
def _file_url_path(url: str) -> Path:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{_shown(url)} names another host; a file URL names a file on this server: file:///path")
    return Path(urllib.request.url2pathname(parts.path))


def _read_local(given: str, path: Path, limits: MediaLimits) -> tuple[bytes, str]:
    """The file at `path` (relative: to the allowed directory), if inside that directory."""
    root = limits.allowed_local_dir
    shown = _shown(given)
    if root is None:
        raise MediaError(
            f"{shown} is not an http(s) URL, a data URL or base64; local file paths are refused unless "
            f"the server is started with {LOCAL_MEDIA_FLAG} DIR")
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise MediaError(f"{shown} lies outside the directory this server reads local images from "
                         f"({LOCAL_MEDIA_FLAG})")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(resolved, flags)
    except FileNotFoundError:
        raise MediaError(f"no file {shown}") from None
    except OSError as e:
        raise MediaError(f"cannot read {shown}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"{shown} is not a regular file")
        _check_bytes(info.st_size, shown, limits)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limits.max_bytes + 1)
    finally:
        os.close(fd)
    _check_bytes(len(data), shown, limits)
    return data, shown


# ---------------------------------------------------------------------- decoding
def _decode(data: bytes, what: str, limits: MediaLimits) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise MediaError(f"{what} has more pixels than this server's limit of {_pixel_limit(limits)} "
                         "pixels per image") from None
    except (OSError, SyntaxError, ValueError, EOFError):
        raise MediaError(f"{what} is not an image in a format this server reads ({', '.join(FORMATS)})") from None
    with image:
        width, height = image.size
        if width * height > _pixel_limit(limits):
            raise MediaError(f"{what} is {width}x{height} = {width * height} pixels, over this server's limit "
                             f"of {_pixel_limit(limits)} pixels per image")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise MediaError(f"{what} could not be decoded, truncated or corrupt: {_shown(str(e))}") from None
        return _to_rgb(image)


def _pixel_limit(limits: MediaLimits) -> int:
    """`max_pixels`, or PIL's bomb limit where that is lower (PIL warns past it)."""
    pil = Image.MAX_IMAGE_PIXELS
    return limits.max_pixels if pil is None else min(limits.max_pixels, int(pil))


def _to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB, its transparency composited onto white (transformers' rule)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")
