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
  its subdomains; a host name of letters, digits, dots and dashes), on the scheme's own
  port (80, 443) unless the entry names another (`cdn.internal:8080`);
- at most `MAX_FETCHES` distinct URLs a request, and the images may add to a request no
  more than the proxy's body limit (a URL repeated past it stays a URL);
- every address the name resolves to must be a public one (not loopback, private,
  link-local, multicast or reserved: a listed name that resolves inside the network is
  refused), unless the listed host is itself that IP address, which the operator then
  asked for by number; the connection goes to the addresses so checked;
- no redirect is followed; at most `MAX_FETCH_BYTES`, within `FETCH_TIMEOUT` seconds;
- the answer must be 200 with an image media type the store keeps (png, jpeg, gif, webp).

A fetch that fails leaves the URL as the client sent it (vLLM fetches it as before, the
turn is not trained) and the note says why, naming the URL without its credentials or
query. The request is never failed for it. A request not logged (`X-Rollout-Log: off`)
is not fetched for: its record keeps no picture.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import re
import socket
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from overnight.storage.images import MEDIA_TYPES

log = logging.getLogger("overnight.proxy")

MAX_FETCH_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT = 10.0
MAX_FETCHES = 16  # distinct image URLs fetched for one request; more are left as URLs
_DEPTH = 8  # content parts sit a few levels down a request (messages, content, part)
_NAME = re.compile(r"[a-z0-9.-]+")  # a host name as listed and matched: nothing else
_DEFAULT_PORTS = {"http": 80, "https": 443}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class Refused(Exception):
    """Why an image URL was not fetched (said in the record's notes)."""


def public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A public address, and so is any IPv4 address an IPv6 one carries (mapped, 6to4,
    Teredo, NAT64): `::ffff:127.0.0.1` and `64:ff9b::a9fe:a9fe` are not public."""
    if not ip.is_global:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None and not inner.is_global:
            return False
    return True


class HostList:
    """The hosts the operator named: `example.com`, `*.example.com` (its subdomains), or
    an IP address, each on the scheme's own port unless named with one (`host:8080`)."""

    def __init__(self, hosts: tuple[str, ...]):
        self.entries: set[tuple[str, int | None]] = set()
        for entry in hosts:
            entry = entry.strip().lower()
            name, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
            self.entries.add((name.rstrip("."), int(port) if port else None))

    def allows(self, host: str, port: int, scheme: str) -> bool:
        host = host.lower()
        if not (_NAME.fullmatch(host) or _ip_of(host)):  # a NUL, a space: never
            return False
        for name, listed_port in self.entries:
            if listed_port is None and port != _DEFAULT_PORTS[scheme]:
                continue
            if listed_port is not None and port != listed_port:
                continue
            if host == name or (name.startswith("*.") and host.endswith(name[1:])):
                return True
        return False

    def named_by_number(self, address: str) -> bool:
        return any(name == address for name, _ in self.entries)


def _ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host is, where it is one (not a name); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class _CheckedResolver(AbstractResolver):
    """The system resolver, keeping only public addresses: it resolves names (aiohttp
    does not resolve an IP address, which `_fetch` checks), and a name never reaches a
    private one, listed or not. aiohttp connects to the addresses it returns: no second
    lookup for a rebinding name to answer otherwise."""

    def __init__(self):
        self.inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family=socket.AF_INET) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        allowed = [r for r in found if public(ipaddress.ip_address(r["host"].split("%", 1)[0]))]
        if not allowed:
            raise OSError(f"{host} resolves to no public address")
        return allowed

    async def close(self) -> None:
        await self.inner.close()


class ImageFetcher:
    """Fetches the listed hosts' image URLs of a request (`inline`); one client session
    for the proxy's life (`close` on cleanup). `budget`: the most bytes the fetched
    images may add to one request (the proxy's body limit: what a client could have
    sent inline itself), counted at every place a URL is replaced."""

    def __init__(self, hosts: tuple[str, ...], budget: int):
        self.hosts = HostList(hosts)
        self.budget = budget
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=_CheckedResolver(), limit=64, limit_per_host=8
            )
            timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def inline(self, body: dict) -> tuple[dict, dict | None]:
        """(`body` with each fetched image's URL replaced by its data URL, a note of
        what was fetched or why not, by URL without its credentials or query); `body`
        itself when nothing was. It never raises for what a client sent."""
        try:
            return await self._inline(body)
        except Exception as e:  # a shape or URL not foreseen: the request goes as sent
            log.warning("image URLs not fetched: %s: %s", type(e).__name__, e)
            return body, {"error": f"{type(e).__name__}: {str(e)[:160]}"}

    async def _inline(self, body: dict) -> tuple[dict, dict | None]:
        unique = list(dict.fromkeys(u for u in _image_urls(body, 0) if self._listed(u)))
        if not unique:
            return body, None
        note = {_shown(u): f"not fetched: more than {MAX_FETCHES} image URLs in the request"
                for u in unique[MAX_FETCHES:]}  # fmt: skip
        unique = unique[:MAX_FETCHES]
        results = await asyncio.gather(*(self._fetch(u) for u in unique), return_exceptions=True)
        data_urls = {}
        for url, result in zip(unique, results, strict=True):
            if isinstance(result, BaseException):
                note[_shown(url)] = f"not fetched: {_why(result)}"
            else:
                data_urls[url] = result
                note[_shown(url)] = "fetched"
        if not data_urls:
            return body, note
        left = [self.budget]
        replaced = _replaced(body, data_urls, 0, left)
        if left[0] < 0:  # some places kept their URL: the request's budget was spent
            for url in data_urls:
                note[_shown(url)] = "fetched; where it repeats past the request's budget, the URL"
        return replaced, note

    def _listed(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
            scheme, host, port = parts.scheme, parts.hostname or "", parts.port
        except ValueError:  # not a URL urllib can read: not one to fetch
            return False
        if scheme not in _DEFAULT_PORTS:
            return False
        return self.hosts.allows(host, port or _DEFAULT_PORTS[scheme], scheme)

    async def _fetch(self, url: str) -> str:
        host = urlsplit(url).hostname or ""
        ip = _ip_of(host)  # an IP address is not resolved (nor checked by the resolver)
        if ip is not None and not (public(ip) or self.hosts.named_by_number(str(ip))):
            raise Refused(f"{host} is not a public address (list it by number to allow it)")
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
        encoded = await asyncio.to_thread(base64.b64encode, bytes(data))  # off the loop
        return f"data:{media_type};base64,{encoded.decode('ascii')}"


def _shown(url: str) -> str:
    """A URL as notes name it: no credentials, no query or fragment (a signed URL's)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<a URL that does not parse>"
    return f"{parts.scheme}://{host}{port}{parts.path}"[:300]


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


def _replaced(value: Any, data_urls: dict[str, str], depth: int, left: list[int]) -> Any:
    """A copy of `value` with each fetched URL's part holding its data URL (in the part's
    own shape: a Messages part becomes base64) while `left[0]` bytes allow (each place
    costs its data URL's length; past it the URL stays); what is not changed is shared."""
    if depth > _DEPTH:
        return value
    if isinstance(value, list):
        return [_replaced(item, data_urls, depth + 1, left) for item in value]
    if not isinstance(value, dict):
        return value
    url = _url_of(value)
    if url is not None:
        data = data_urls.get(url)
        if data is None:
            return value
        left[0] -= len(data)
        return value if left[0] < 0 else _with_data(value, data)
    return {key: _replaced(item, data_urls, depth + 1, left) for key, item in value.items()}


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
