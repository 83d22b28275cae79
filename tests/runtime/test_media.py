"""`load_image`: every form a client may send gives the same pixels, and every refusal is a
`MediaError` saying what was wrong. The http cases run against a real server on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from sprig.runtime.multimodal import media
from sprig.runtime.multimodal.media import MediaError, MediaLimits, load_image


def picture(size: tuple[int, int] = (5, 4)) -> Image.Image:
    """An RGB picture whose every pixel differs."""
    image = Image.new("RGB", size)
    image.putdata([((x * 37) % 256, (y * 59) % 256, (x * y * 11) % 256) for y in range(size[1]) for x in range(size[0])])
    return image


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def pixels(image: Image.Image) -> list[tuple[int, ...]]:
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` and which holds no pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


FILES = {"png": encoded(picture(), "PNG"), "jpeg": encoded(picture(), "JPEG", quality=90)}


# ---------------------------------------------------------------------- a real http server
class Handler(BaseHTTPRequestHandler):
    server: ImageServer

    def do_GET(self) -> None:
        self.server.hits.append(self.path)
        name = self.path.strip("/").replace(".", "_")
        getattr(self, f"route_{name}", self.route_missing)()

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def route_img_png(self) -> None:
        self._send(200, FILES["png"], "image/png")

    def route_img_jpeg(self) -> None:
        self._send(200, FILES["jpeg"], "image/jpeg")

    def route_missing(self) -> None:
        self._send(404, b"not found", "text/plain")

    def route_page(self) -> None:
        self._send(200, b"<html><body>an image was here</body></html>", "text/html")

    def route_nothing(self) -> None:
        self.send_response(204)
        self.end_headers()

    def route_declared_huge(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(10**9))
        self.end_headers()

    def route_endless(self) -> None:
        """A body with no length that never ends (up to 1 GiB): a reader that checked the
        cap only after reading it all would wait here."""
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        block = b"\0" * 65536
        try:
            while self.server.sent < 2**30:
                self.wfile.write(block)
                self.server.sent += len(block)
        except OSError:
            return

    def route_hang(self) -> None:
        self.server.release.wait(30)

    def log_message(self, *args: object) -> None:
        pass


class ImageServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.hits: list[str] = []
        self.sent = 0
        self.release = threading.Event()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


@pytest.fixture
def server() -> Iterator[ImageServer]:
    httpd = ImageServer()
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)  # shutdown() waits up to one poll
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    root.mkdir()
    for kind, data in FILES.items():
        (root / f"img.{kind}").write_bytes(data)
    (tmp_path / "secret.png").write_bytes(FILES["png"])
    return root


def refused(source: str | bytes, limits: MediaLimits, *needles: str) -> str:
    """The MediaError message for `source`, which must contain every needle."""
    with pytest.raises(MediaError) as caught:
        load_image(source, limits)
    message = str(caught.value)
    for needle in needles:
        assert needle in message
    assert "Traceback" not in message
    return message


# ---------------------------------------------------------------------- every form, the same pixels
FORMS: dict[str, Callable[[str, ImageServer, Path], str | bytes]] = {
    "bytes": lambda kind, srv, root: FILES[kind],
    "data URL": lambda kind, srv, root: f"data:image/{kind};base64," + base64.b64encode(FILES[kind]).decode(),
    "base64": lambda kind, srv, root: base64.b64encode(FILES[kind]).decode(),
    "http": lambda kind, srv, root: srv.url(f"/img.{kind}"),
    "file URL": lambda kind, srv, root: (root / f"img.{kind}").as_uri(),
    "path": lambda kind, srv, root: str(root / f"img.{kind}"),
    "relative path": lambda kind, srv, root: f"img.{kind}",
}


@pytest.mark.parametrize("kind", sorted(FILES))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_loads_the_same_pixels(kind: str, form: str, server: ImageServer, allowed: Path) -> None:
    image = load_image(FORMS[form](kind, server, allowed), MediaLimits(allowed_local_dir=allowed))
    expected = Image.open(io.BytesIO(FILES[kind]))
    expected.load()
    assert image.mode == "RGB" and image.size == (5, 4)
    assert image.tobytes() == expected.convert("RGB").tobytes()
    if kind == "png":
        assert image.tobytes() == picture().tobytes()


def test_transparency_is_composited_onto_white() -> None:
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 0), (0, 0, 255, 255), (0, 0, 255, 128)])
    image = load_image(encoded(rgba, "PNG"), MediaLimits())
    assert image.mode == "RGB"
    assert pixels(image) == [(255, 255, 255), (0, 0, 255), (127, 127, 255)]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.putdata([0, 1])
    image = load_image(encoded(palette, "GIF", transparency=0), MediaLimits())
    assert pixels(image) == [(255, 255, 255), (10, 200, 30)]


def test_an_animated_image_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in ((200, 0, 0), (0, 200, 0), (0, 0, 200))]
    data = encoded(frames[0], "PNG", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(data)).n_frames == 3
    image = load_image(data, MediaLimits())
    assert set(pixels(image)) == {(200, 0, 0)}


def test_a_symlink_inside_the_allowed_directory_is_followed(allowed: Path) -> None:
    (allowed / "link.png").symlink_to(allowed / "img.png")
    assert load_image("link.png", MediaLimits(allowed_local_dir=allowed)).tobytes() == picture().tobytes()


# ---------------------------------------------------------------------- refusals: sizes
def test_too_many_bytes_in_every_form(server: ImageServer, allowed: Path) -> None:
    limits = MediaLimits(max_bytes=len(FILES["png"]) - 1, allowed_local_dir=allowed)
    limit = f"limit of {limits.max_bytes} bytes"
    refused(FILES["png"], limits, f"{len(FILES['png'])} bytes", limit)
    refused(FORMS["data URL"]("png", server, allowed), limits, "data URL", limit)
    refused(FORMS["base64"]("png", server, allowed), limits, "base64", limit)
    refused(FORMS["http"]("png", server, allowed), limits, "/img.png", limit)
    refused(FORMS["path"]("png", server, allowed), limits, limit)


def test_base64_is_measured_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decoded before the length check")

    monkeypatch.setattr(media.base64, "b64decode", no_decoding)
    huge = "A" * 4_000_000
    refused(huge, MediaLimits(max_bytes=1000), "about 3000000 bytes", "limit of 1000 bytes")
    refused("data:image/png;base64," + huge, MediaLimits(max_bytes=1000), "data URL", "limit of 1000 bytes")
    refused(huge + "!", MediaLimits(max_bytes=1000), "limit of 1000 bytes")


def test_too_many_pixels_is_refused_from_the_header() -> None:
    """The forged files hold no pixel data: decoding them would fail as truncated."""
    refused(png_header_only(8000, 8000), MediaLimits(), "8000x8000 = 64000000 pixels", "limit of 50000000 pixels")
    refused(FILES["png"], MediaLimits(max_pixels=19), "5x4 = 20 pixels", "limit of 19 pixels")
    assert load_image(FILES["png"], MediaLimits(max_pixels=20)).size == (5, 4)


def test_pil_decompression_bomb_limits_refuse_too() -> None:
    refused(png_header_only(100_000, 100_000), MediaLimits(max_pixels=10**12), "more pixels than",
            f"limit of {Image.MAX_IMAGE_PIXELS} pixels")
    with pytest.warns(Image.DecompressionBombWarning):
        refused(png_header_only(10_000, 10_000), MediaLimits(max_pixels=10**12), "10000x10000",
                f"limit of {Image.MAX_IMAGE_PIXELS} pixels")


# ---------------------------------------------------------------------- refusals: content
def test_bad_base64() -> None:
    refused("data:image/png;base64,@@@@", MediaLimits(), "data URL", "not valid base64")
    refused("abcde", MediaLimits(), "base64 image", "not valid base64")
    refused("data:text/plain,hello", MediaLimits(), "must be base64")


def test_not_an_image() -> None:
    refused(b"just some text, no picture", MediaLimits(), "not an image", "PNG, JPEG")
    refused(base64.b64encode(b"just some text").decode(), MediaLimits(), "base64 image", "not an image")
    refused(encoded(picture(), "PPM"), MediaLimits(), "not an image in a format this server reads")
    refused(12345, MediaLimits(), "not int")  # type: ignore[arg-type]
    refused("   ", MediaLimits(), "empty")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_truncated_image_fails_to_decode(fmt: str) -> None:
    data = encoded(picture((64, 64)), fmt)
    refused(data[: len(data) * 2 // 3], MediaLimits(), "truncated or corrupt")


# ---------------------------------------------------------------------- refusals: local files
def test_local_paths_need_the_flag(allowed: Path) -> None:
    for source in (str(allowed / "img.png"), (allowed / "img.png").as_uri(), "img.png"):
        refused(source, MediaLimits(), "local file paths are refused", "--allowed-local-media-path")


def test_a_path_escaping_the_allowed_directory_is_refused(allowed: Path, tmp_path: Path) -> None:
    limits = MediaLimits(allowed_local_dir=allowed)
    message = refused("../secret.png", limits, "'../secret.png'", "outside the directory")
    assert str(tmp_path) not in message
    refused(str(allowed / ".." / "secret.png"), limits, "outside the directory")
    refused((tmp_path / "secret.png").as_uri(), limits, "outside the directory")
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    message = refused("escape.png", limits, "'escape.png'", "outside the directory")
    assert str(tmp_path) not in message


def test_missing_and_odd_local_files(allowed: Path) -> None:
    limits = MediaLimits(allowed_local_dir=allowed)
    refused("absent.png", limits, "no file 'absent.png'")
    (allowed / "a.folder").mkdir()
    refused("a.folder", limits, "'a.folder' is not a regular file")
    refused("file://otherhost/img.png", limits, "another host")


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        MediaLimits(max_bytes=0)
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        MediaLimits(fetch_timeout_s=-1)
    with pytest.raises(ValueError, match="not a directory"):
        MediaLimits(allowed_local_dir=Path("/nonexistent/sprig-media"))


def test_the_allowed_directory_is_stored_resolved(tmp_path: Path, allowed: Path) -> None:
    (tmp_path / "alias").symlink_to(allowed)
    limits = MediaLimits(allowed_local_dir=tmp_path / "alias")
    assert limits.allowed_local_dir == allowed.resolve()
    assert load_image("img.png", limits).tobytes() == picture().tobytes()


# ---------------------------------------------------------------------- refusals: http
def test_http_when_disallowed_is_not_fetched(server: ImageServer) -> None:
    refused(server.url("/img.png"), MediaLimits(allow_http=False), "does not fetch images from URLs")
    assert server.hits == []


def test_http_statuses_other_than_200(server: ImageServer) -> None:
    refused(server.url("/missing"), MediaLimits(), "/missing", "HTTP 404")
    refused(server.url("/nothing"), MediaLimits(), "/nothing", "HTTP 204")


def test_a_body_that_is_not_an_image(server: ImageServer) -> None:
    refused(server.url("/page"), MediaLimits(), "/page", "text/html", "not an image")


def test_the_byte_cap_holds_while_the_body_streams(server: ImageServer) -> None:
    start = time.monotonic()
    refused(server.url("/endless"), MediaLimits(max_bytes=256 * 1024), "/endless", "limit of 262144 bytes")
    assert time.monotonic() - start < 10
    assert server.sent < 2**30
    refused(server.url("/declared_huge"), MediaLimits(max_bytes=256 * 1024), "1000000000 bytes",
            "limit of 262144 bytes")


def test_a_server_that_never_answers_times_out(server: ImageServer) -> None:
    start = time.monotonic()
    refused(server.url("/hang"), MediaLimits(fetch_timeout_s=0.3), "/hang", "limit of 0.3 s")
    assert time.monotonic() - start < 5


def test_an_unreachable_host() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as closed:
        port = closed.server_address[1]
    refused(f"http://127.0.0.1:{port}/img.png", MediaLimits(fetch_timeout_s=2), "fetching", "failed")
