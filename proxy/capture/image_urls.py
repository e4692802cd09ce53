"""Images given by URL, fetched by the proxy where the operator asks (`--fetch-images-from`).

An image part with an http(s) URL is recorded as its URL and never fetched: vLLM
fetches it to answer, and the proxy has no business reaching out where a client points
it. A night cannot train on such a turn (it has no pixels to rebuild). An operator whose
agents show pictures from known hosts (their own CDN, a screenshot service) can name
those hosts; for them the proxy fetches each image once, before forwarding, and sends
vLLM the bytes it fetched as a data URL. vLLM then sees exactly what is stored: the
record holds the picture (moved to the image store as any base64 image is), the URL it
came from is in the record's notes (`images_fetched`), and the night trains on it.

A fetch is an outbound request a client caused, so it is held to what the operator
allowed and no further:

- only `http` and `https`, only to a listed host (`example.com`, or `*.example.com` for
  its subdomains), on the URL's own port;
- every address the name resolves to must be a public one (not loopback, private,
  link-local, multicast or reserved: a listed name that resolves inside the network is
  refused), unless the listed host is itself that IP address, which the operator then
  asked for by number; the connection goes to the addresses so checked;
- no redirect is followed; at most `MAX_FETCH_BYTES`, within `FETCH_TIMEOUT` seconds;
- the answer must be 200 with an image media type the store keeps (png, jpeg, gif, webp).

A fetch that fails leaves the URL as the client sent it (vLLM fetches it as before, the
turn is not trained) and the note says why. The request is never failed for it.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from overnight.storage.images import MEDIA_TYPES

MAX_FETCH_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT = 10.0
MAX_FETCHES = 16  # image URLs fetched for one request; more are left as URLs
_DEPTH = 8  # content parts sit a few levels down a request (messages, content, part)


class Refused(Exception):
    """Why an image URL was not fetched (said in the record's notes)."""


class HostList:
    """The hosts the operator named: `example.com`, `*.example.com`, or an IP address."""

    def __init__(self, hosts: tuple[str, ...]):
        self.exact = {h.lower().rstrip(".") for h in hosts if not h.startswith("*.")}
        self.suffixes = tuple(h[1:].lower().rstrip(".") for h in hosts if h.startswith("*."))

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return host in self.exact or any(host.endswith(s) for s in self.suffixes)

    def named_by_number(self, address: str) -> bool:
        return address in self.exact


class _CheckedResolver(AbstractResolver):
    """The system resolver, keeping only public addresses: it resolves names (aiohttp
    does not resolve an IP address, which `_fetch` checks), and a name never reaches a
    private one, listed or not."""

    def __init__(self):
        self.inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family=socket.AF_INET) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        allowed = [r for r in found if ipaddress.ip_address(r["host"].split("%", 1)[0]).is_global]
        if not allowed:
            raise OSError(f"{host} resolves to no public address")
        return allowed

    async def close(self) -> None:
        await self.inner.close()


class ImageFetcher:
    """Fetches the listed hosts' image URLs of a request (`inline`); one client session
    for the proxy's life (`close` on cleanup)."""

    def __init__(self, hosts: tuple[str, ...]):
        self.hosts = HostList(hosts)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=_CheckedResolver(), limit=16)
            timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def inline(self, body: dict) -> tuple[dict, dict | None]:
        """(`body` with each fetched image's URL replaced by its data URL, a note of
        what was fetched or refused); `body` itself when nothing was."""
        urls = [u for u in _image_urls(body, 0) if self._listed(u)][:MAX_FETCHES]
        if not urls:
            return body, None
        unique = list(dict.fromkeys(urls))
        results = await asyncio.gather(*(self._fetch(u) for u in unique), return_exceptions=True)
        data_urls, note = {}, {}
        for url, result in zip(unique, results, strict=True):
            if isinstance(result, BaseException):
                note[url] = f"not fetched: {_why(result)}"
            else:
                data_urls[url] = result
                note[url] = "fetched"
        return (_replaced(body, data_urls, 0) if data_urls else body), note

    def _listed(self, url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and self.hosts.allows(parts.hostname or "")

    async def _fetch(self, url: str) -> str:
        host = urlsplit(url).hostname or ""
        try:  # an IP address is not resolved (nor checked by the resolver): checked here
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None and not (ip.is_global or self.hosts.named_by_number(str(ip))):
            raise Refused(f"{host} is not a public address (name it by number to allow it)")
        async with self.session().get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise Refused(f"HTTP {response.status}")
            media_type = response.content_type
            if media_type not in MEDIA_TYPES:
                raise Refused(f"{media_type or 'no media type'} is not an image the store keeps")
            if (response.content_length or 0) > MAX_FETCH_BYTES:
                raise Refused(f"{response.content_length} bytes, more than {MAX_FETCH_BYTES}")
            data = bytearray()
            async for chunk in response.content.iter_chunked(65536):
                data += chunk
                if len(data) > MAX_FETCH_BYTES:
                    raise Refused(f"more than {MAX_FETCH_BYTES} bytes")
        return f"data:{media_type};base64,{base64.b64encode(bytes(data)).decode('ascii')}"


def _why(e: BaseException) -> str:
    if isinstance(e, Refused):
        return str(e)
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return f"no answer within {FETCH_TIMEOUT:g} s"
    if isinstance(e, aiohttp.ClientConnectorError):  # the resolver's refusal is its cause
        return f"cannot connect: {str(e.os_error or e.__cause__ or e)[:160]}"
    return f"{type(e).__name__}: {str(e)[:160]}"


def _url_of(part: dict) -> str | None:
    """An image part's http(s) URL in any of the three shapes; None for anything else."""
    kind = part.get("type")
    if kind == "image_url":
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else inner
    elif kind == "input_image":
        url = part.get("image_url")
    elif kind == "image" and isinstance(part.get("source"), dict):
        source = part["source"]
        url = source.get("url") if source.get("type") == "url" else None
    else:
        return None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


def _image_urls(value: Any, depth: int) -> list[str]:
    if depth > _DEPTH:
        return []
    if isinstance(value, list):
        return [u for item in value for u in _image_urls(item, depth + 1)]
    if not isinstance(value, dict):
        return []
    url = _url_of(value)
    if url is not None:
        return [url]
    return [u for item in value.values() for u in _image_urls(item, depth + 1)]


def _replaced(value: Any, data_urls: dict[str, str], depth: int) -> Any:
    """A copy of `value` with each fetched URL's part holding its data URL (in the part's
    own shape: a Messages part becomes base64); what is not changed is shared."""
    if depth > _DEPTH:
        return value
    if isinstance(value, list):
        return [_replaced(item, data_urls, depth + 1) for item in value]
    if not isinstance(value, dict):
        return value
    url = _url_of(value)
    if url is not None:
        data = data_urls.get(url)
        return value if data is None else _with_data(value, data)
    return {key: _replaced(item, data_urls, depth + 1) for key, item in value.items()}


def _with_data(part: dict, data_url: str) -> dict:
    kind = part["type"]
    if kind == "image_url":
        inner = part["image_url"]
        return {
            **part,
            "image_url": {**inner, "url": data_url} if isinstance(inner, dict) else data_url,
        }
    if kind == "input_image":
        return {**part, "image_url": data_url}
    media_type, data = data_url[len("data:") :].split(";base64,", 1)
    return {**part, "source": {"type": "base64", "media_type": media_type, "data": data}}


IMAGE_FETCHER = web.AppKey("image_fetcher", ImageFetcher)
# A request's fetched image URLs (url -> "fetched" or why not), for its record's notes.
IMAGES_FETCHED = web.RequestKey("overnight_images_fetched", dict)
