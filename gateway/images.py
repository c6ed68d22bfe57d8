"""Images in requests, as every API sends them, to the protocol's `ImagePart`: a data URL (Chat Completions'
`image_url.url`, Responses' `image_url`), bare base64 (llama-server takes it there too), or Anthropic's base64
`source`. Each image is decoded and checked before the request goes on, each problem a 400 naming the field:

- a URL the server would have to fetch (`http(s)://`, Anthropic's `source.type: "url"`) is refused unless the
  operator turned fetching on (`--image-fetch`: a request could make the server reach any host its network can); with
  it on, the image is fetched after the body is decoded (`Images.fetch`, on the event loop, all of a request's images
  at once, within gateway/image_fetch.py's bounds), its bytes then checked as an image sent in the request;
- base64 that does not decode, a media type that is not an image, or bytes whose signature is none of PNG, JPEG,
  GIF, BMP, WebP (what llama.cpp's image loader reads);
- the bounds (`ImageLimits`, the HTTP server's flags): bytes per image, images per request, and pixels, read from
  the file's header (its width and height, without decoding the image): at most `max_side` on a side and
  `max_pixels` in all (a 100 KB PNG can claim a 50,000 x 50,000 canvas).

The work is done where the body is decoded: on a thread for a body over gateway/app.py's DECODE_INLINE_BYTES (an
image of more than a few KB), never on the event loop; an image by URL leaves its part to be filled by `fetch`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import struct
from dataclasses import dataclass
from typing import NoReturn

from gateway import image_fetch
from gateway.errors import RequestError
from protocol import ImagePart

MiB = 1024 * 1024
FORMATS = "PNG, JPEG, GIF, BMP or WebP"
_SPACE = re.compile(r"\s+")
_URL_SAFE = str.maketrans("-_", "+/")
_HEAD = 256  # characters of a data URL before its comma, at most


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (the HTTP server's --max-image-bytes, --max-images, --max-image-side and
    --max-image-pixels), and whether an image may be given by http(s) URL (--image-fetch, --image-fetch-timeout-s)."""

    max_bytes: int = 20 * MiB
    max_images: int = 16
    max_side: int = 8192
    max_pixels: int = 33_000_000
    fetch: bool = False
    fetch_timeout_s: float = 10.0


class Images:
    """One request's images, as its API's decoder meets them: each decoded, checked and counted."""

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()
        self.count = 0
        self.remote: list[tuple[str, str, ImagePart]] = []  # images by URL, to fetch: (URL, its field, their part)

    def url(self, url: str, *, part: str, field: str, detail: str | None = None) -> ImagePart:
        """The image a URL holds: a data URL (`data:image/png;base64,...`), bare base64, or (with --image-fetch) an
        http(s) URL (`by_url`). `part` names the content part (for the count), `field` the URL's field (for what is
        wrong with it)."""
        head = url[:16].lower()
        if head.startswith(("http://", "https://")):
            return self.by_url(url, part=part, field=field, detail=detail)
        if head.startswith("data:"):
            comma = url.find(",", 0, _HEAD)
            if comma < 0:
                raise RequestError(f"`{field}` is not a data URL: no comma ends its header", param=field)
            params = url[5:comma].split(";")
            if params[-1].strip().lower() != "base64":
                raise RequestError(f"`{field}`: a data URL's image must be base64 (data:image/png;base64,...)", param=field)
            return self.base64(url[comma + 1 :], params[0].strip() or None, part=part, field=field, detail=detail)
        if ":" in head and not head.startswith(":"):
            scheme = head.split(":", 1)[0]
            if scheme.isalpha():  # (base64 has no colon: this is a URL of another scheme)
                raise RequestError(
                    f"`{field}`: {scheme}: URLs are not served; send the image itself as a data URL (data:image/png;base64,...)",
                    param=field,
                )
        return self.base64(url, None, part=part, field=field, detail=detail)

    def by_url(self, url: str, *, part: str, field: str, detail: str | None = None) -> ImagePart:
        """The image at an http(s) URL: refused unless --image-fetch; else counted now, and its part (returned empty)
        filled by `fetch`, once the whole body is decoded."""
        if not self.limits.fetch:
            raise RequestError(
                f"`{field}`: this server does not fetch URLs (its operator has not turned on --image-fetch); send the "
                "image itself as a data URL (data:image/png;base64,...)",
                param=field,
            )
        self.counted(part)
        hole = ImagePart(data=b"", detail=detail)  # (empty: the protocol refuses it, should it go on unfilled)
        self.remote.append((url, field, hole))
        return hole

    async def fetch(self) -> None:
        """Fetch the images given by URL, all at once (gateway/image_fetch.py), each checked as an image sent in the
        request and put in its part; the first that fails (in the request's order) is the RequestError."""
        remote, self.remote = self.remote, []
        if not remote:
            return
        limits = self.limits
        tasks = [
            asyncio.ensure_future(image_fetch.fetch(url, field, max_bytes=limits.max_bytes, timeout_s=limits.fetch_timeout_s))
            for url, field, _ in remote
        ]
        try:
            for (_, field, hole), task in zip(remote, tasks, strict=True):
                hole.data = self.checked(await task, field)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def counted(self, part: str) -> None:
        """One image more in the request (`part`: its content part), within --max-images."""
        self.count += 1
        if self.count > self.limits.max_images:
            raise RequestError(f"`{part}`: more than {self.limits.max_images} images in one request (--max-images)", param=part)

    def base64(self, data: str, media_type: str | None, *, part: str, field: str, detail: str | None = None) -> ImagePart:
        """The image base64 text holds, its media type as the client declared it (None: not declared)."""
        self.counted(part)
        if media_type is not None and not media_type.lower().startswith("image/"):
            raise RequestError(f"`{field}`: media type {media_type[:64]!r} is not an image", param=field)
        limit = self.limits.max_bytes
        if len(data) > 8 * (limit // 3 + 1):  # (over even with a line break after every character: not decoded)
            too_many(field, None, limit)
        return ImagePart(data=self.checked(decoded(data, field), field), detail=detail)

    def checked(self, raw: bytes, field: str) -> bytes:
        """An image's bytes, as sent or fetched, within the bounds: bytes, then its format and pixels from its header."""
        limit = self.limits.max_bytes
        if len(raw) > limit:
            too_many(field, len(raw), limit)
        kind, width, height = image_size(raw, field)
        if width > self.limits.max_side or height > self.limits.max_side:
            raise RequestError(
                f"`{field}`: the {kind} image is {width}x{height} pixels; at most {self.limits.max_side} on a side are "
                "served (--max-image-side)",
                param=field,
            )
        if width * height > self.limits.max_pixels:
            raise RequestError(
                f"`{field}`: the {kind} image is {width}x{height} = {width * height} pixels; at most "
                f"{self.limits.max_pixels} are served (--max-image-pixels)",
                param=field,
            )
        return raw


def too_many(field: str, size: int | None, limit: int) -> NoReturn:
    """A 400 for an image over `limit` bytes (`size`: its bytes, None when it was too long to decode)."""
    what = f"{size} bytes" if size is not None else "longer"
    raise RequestError(
        f"`{field}`: the image is {what}, over this server's {limit} bytes per image (--max-image-bytes)", param=field
    )


def decoded(text: str, field: str) -> bytes:
    """Base64 text's bytes: the standard alphabet with padding, or (as browsers and other servers take it) with line
    breaks, the URL-safe alphabet or the padding left out."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    cleaned = _SPACE.sub("", text).translate(_URL_SAFE)
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        raw = base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"`{field}` is not valid base64", param=field) from None
    if not raw:
        raise RequestError(f"`{field}` holds no image: it is empty", param=field)
    return raw


# ---- the header reader ------------------------------------------------------------------------------------------

_JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # SOFn (not DHT, JPG, DAC)
_JPEG_SEGMENTS = 1024  # segments read looking for the frame header (a camera's JPEG has a few dozen before it)


def image_format(data: bytes) -> str | None:
    """The image format `data` begins with (its signature), or None for none kvroute serves."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"BM"):
        return "BMP"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WebP"
    return None


def image_size(data: bytes, field: str = "image") -> tuple[str, int, int]:
    """(format, width, height) from the image's header alone; a RequestError naming `field` when the bytes are not an
    image of a format served, or their header is cut short or says nothing sensible."""
    kind = image_format(data)
    if kind is None:
        raise RequestError(f"`{field}` is not a {FORMATS} image (its first bytes are no such file's)", param=field)
    try:
        width, height = _SIZES[kind](data)
    except (struct.error, IndexError, ValueError):
        width = height = 0
    if width <= 0 or height <= 0:
        raise RequestError(f"`{field}`: the {kind} image's header is cut short or gives no size", param=field)
    return kind, width, height


def _png(data: bytes) -> tuple[int, int]:
    if data[12:16] != b"IHDR":
        raise ValueError("no IHDR")
    w, h = struct.unpack_from(">II", data, 16)
    return int(w), int(h)


def _gif(data: bytes) -> tuple[int, int]:
    w, h = struct.unpack_from("<HH", data, 6)
    return int(w), int(h)


def _bmp(data: bytes) -> tuple[int, int]:
    (header,) = struct.unpack_from("<I", data, 14)
    if header == 12:  # BITMAPCOREHEADER: 16-bit sizes
        w, h = struct.unpack_from("<HH", data, 18)
    else:  # BITMAPINFOHEADER and later: signed 32-bit, a negative height is a top-down image
        w, h = struct.unpack_from("<ii", data, 18)
    return int(w), abs(int(h))


def _webp(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: a key frame's start code, then 14-bit sizes
        if data[23:26] != b"\x9d\x01\x2a":
            raise ValueError("no VP8 start code")
        w, h = struct.unpack_from("<HH", data, 26)
        return int(w) & 0x3FFF, int(h) & 0x3FFF
    if chunk == b"VP8L":  # lossless: a signature byte, then 14 bits each of size minus one
        if data[20] != 0x2F:
            raise ValueError("no VP8L signature")
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended: the canvas, 24 bits each of size minus one
        if len(data) < 30:
            raise ValueError("cut short")
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    raise ValueError("no VP8 chunk")


def _jpeg(data: bytes) -> tuple[int, int]:
    i = 2
    for _ in range(_JPEG_SEGMENTS):
        while data[i] == 0xFF and data[i + 1] == 0xFF:  # (fill bytes before a marker)
            i += 1
        if data[i] != 0xFF:
            raise ValueError("no marker")
        marker = data[i + 1]
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # (markers without a segment)
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # the image's end, or its scan, before any frame header
            raise ValueError("no frame header")
        if marker in _JPEG_FRAMES:
            h, w = struct.unpack_from(">HH", data, i + 5)
            return int(w), int(h)
        (length,) = struct.unpack_from(">H", data, i + 2)
        if length < 2:
            raise ValueError("bad segment length")
        i += 2 + length
    raise ValueError("no frame header in the first segments")


_SIZES = {"PNG": _png, "JPEG": _jpeg, "GIF": _gif, "BMP": _bmp, "WebP": _webp}
