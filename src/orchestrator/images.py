"""Images in requests, checked at the edge without decoding a pixel.

Every API hands its image parts here (`image_bytes`): a data URI, bare base64 (Ollama), or
bytes (the Python API). `check_image` reads the file's header by hand (PNG, JPEG, GIF, WebP:
the formats OpenAI and Anthropic take) for its format and size, and refuses bytes that are no
such image, a file over `MAX_IMAGE_BYTES` or an image over `MAX_IMAGE_PIXELS`, each an
`InvalidField` naming the API's field. Pixels are decoded only in the worker
(`worker/vision.py`); this module imports neither MLX nor Pillow.

Remote URLs are refused unless the server was started with ``--allow-image-urls``: then the
HTTP layer fetches a request's image URLs (`prefetch`, off the event loop, each within
`image_fetch_timeout_s`) before its API's schema is turned into a `Request`, and `image_bytes`
takes the fetched bytes from `PREFETCHED`, the request's own context.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import struct
import urllib.error
import urllib.request
from contextvars import ContextVar
from dataclasses import dataclass

from ..ipc.protocol import InvalidField

#: Largest image file, bytes (OpenAI's limit per image; the HTTP body limit, --max-body-bytes, also bounds
#: what a request can carry).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Largest image, pixels (an 8K frame): Pillow would warn of a decompression bomb at 89M.
MAX_IMAGE_PIXELS = 7680 * 4320
#: Most images in one request, and most bytes of them together (a request travels to its worker as one
#: frame, at most `ipc.channel.MAX_FRAME_BYTES`, 256 MiB).
MAX_IMAGES = 16
MAX_REQUEST_IMAGE_BYTES = 64 * 1024 * 1024
FORMATS = ("png", "jpeg", "gif", "webp")
#: How long one remote image may take to fetch, seconds (with --allow-image-urls).
DEFAULT_IMAGE_FETCH_TIMEOUT_S = 10.0
#: A request's fetched image URLs: the bytes, or why the fetch failed (set by the HTTP layer).
PREFETCHED: ContextVar[dict[str, bytes | str] | None] = ContextVar("mlxrt_prefetched_images", default=None)


@dataclass(frozen=True)
class ImageInfo:
    """What an image's header says: its format and its size, pixels."""

    format: str
    width: int
    height: int


def image_bytes(value: object, field: str) -> bytes:
    """The file bytes `value` carries: bytes as they are, a ``data:image/...;base64,`` URI, or bare
    base64 (Ollama's ``images``), checked by `check_image`; `InvalidField` naming `field` otherwise
    (an ``http(s)://`` URL included: remote images are not fetched)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str):
        data = _decode_str(value, field)
    else:
        raise InvalidField(field, f": expected image bytes, a data: URI or base64 text, not "
                                  f"{type(value).__name__}")
    check_image(data, field)
    return data


def _decode_str(value: str, field: str) -> bytes:
    text = value.strip()
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://")):
        fetched = (PREFETCHED.get() or {}).get(text)
        if isinstance(fetched, bytes):
            return fetched
        if isinstance(fetched, str):
            raise InvalidField(field, f": could not fetch {text!r}: {fetched}")
        raise InvalidField(field, ": remote image URLs are not fetched by this server; send the image inline "
                                  "(a data:image/...;base64 URI or base64 data), or start it with "
                                  "--allow-image-urls", code="unsupported", capability="image URLs")
    if lowered.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise InvalidField(field, ": a data URI must be data:image/<format>;base64,<data>")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidField(field, ": not valid base64") from None


def check_image(data: bytes, field: str) -> ImageInfo:
    """The header of the image file `data`; `InvalidField` naming `field` when it is not a PNG, JPEG,
    GIF or WebP whose header gives its size, or when it is over `MAX_IMAGE_BYTES` or `MAX_IMAGE_PIXELS`."""
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidField(field, f": the image is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}")
    info = sniff(data)
    if info is None:
        raise InvalidField(field, f": not an image this server reads ({', '.join(FORMATS)})")
    if info.width <= 0 or info.height <= 0:
        raise InvalidField(field, f": the {info.format} header gives no size ({info.width}x{info.height})")
    if info.width * info.height > MAX_IMAGE_PIXELS:
        raise InvalidField(field, f": the image is {info.width}x{info.height} pixels, over the limit of "
                                  f"{MAX_IMAGE_PIXELS}")
    return info


def check_count(images: list[bytes], field: str = "messages") -> None:
    """`InvalidField` when a request carries more than `MAX_IMAGES` images or `MAX_REQUEST_IMAGE_BYTES`."""
    if len(images) > MAX_IMAGES:
        raise InvalidField(field, f": {len(images)} images in one request, over the limit of {MAX_IMAGES}")
    total = sum(len(i) for i in images)
    if total > MAX_REQUEST_IMAGE_BYTES:
        raise InvalidField(field, f": {total} bytes of images in one request, over the limit of "
                                  f"{MAX_REQUEST_IMAGE_BYTES}")


def sniff(data: bytes) -> ImageInfo | None:
    """The format and size the file's header gives, or None when it is none of `FORMATS` (or cut short)."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            w, h = struct.unpack(">II", data[16:24])
            return ImageInfo("png", w, h)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack("<HH", data[6:10])
            return ImageInfo("gif", w, h)
        if data.startswith(b"\xff\xd8\xff"):
            return _jpeg(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp(data)
    except struct.error:  # a header cut short
        return None
    return None


#: JPEG start-of-frame markers (baseline, progressive, ...): each carries the frame's height and width.
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes) -> ImageInfo | None:
    """Walk the JPEG's marker segments to its first start-of-frame."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return ImageInfo("jpeg", w, h)
        if marker == 0xDA or length < 2:  # scan data before any frame header: not a JPEG to trust
            return None
        i += 2 + length
    return None


def _webp(data: bytes) -> ImageInfo | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return ImageInfo("webp", w & 0x3FFF, h & 0x3FFF)
    if chunk == b"VP8L" and data[20] == 0x2F:
        (bits,) = struct.unpack("<I", data[21:25])
        return ImageInfo("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return ImageInfo("webp", w, h)
    return None


def image_fetch_timeout_s() -> float:
    """Seconds one remote image may take: $MLXRT_IMAGE_FETCH_TIMEOUT_S, else the default."""
    return float(os.environ.get("MLXRT_IMAGE_FETCH_TIMEOUT_S") or DEFAULT_IMAGE_FETCH_TIMEOUT_S)


def remote_urls(value: object) -> list[str]:
    """The http(s) image URLs in a decoded API request: every ``url`` or ``image_url`` field of its
    structs (OpenAI's and Responses' image parts, Anthropic's url sources) that holds one."""
    found: list[str] = []

    def walk(v: object) -> None:
        if isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif hasattr(v, "__struct_fields__"):
            for name in v.__struct_fields__:  # type: ignore[attr-defined]
                x = getattr(v, name)
                if name in ("url", "image_url") and isinstance(x, str) and x[:8].lower().startswith(
                        ("http://", "https://")):
                    found.append(x.strip())
                else:
                    walk(x)

    walk(value)
    return list(dict.fromkeys(found))


async def prefetch(urls: list[str], *, timeout_s: float | None = None) -> dict[str, bytes | str]:
    """Fetch `urls` at once, each in a thread within `timeout_s` (default `image_fetch_timeout_s`) and
    at most `MAX_IMAGE_BYTES` + 1 bytes read: each URL's bytes, or why its fetch failed."""
    limit = image_fetch_timeout_s() if timeout_s is None else timeout_s
    results = await asyncio.gather(*(asyncio.to_thread(_fetch, url, limit) for url in urls))
    return dict(zip(urls, results, strict=True))


def _fetch(url: str, timeout_s: float) -> bytes | str:
    request = urllib.request.Request(url, headers={"User-Agent": "mlxrt"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 (http(s) only)
            return resp.read(MAX_IMAGE_BYTES + 1)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s (set MLXRT_IMAGE_FETCH_TIMEOUT_S)"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", None) or exc)
