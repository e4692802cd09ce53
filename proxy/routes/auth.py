"""Who may call what, and the one middleware that enforces it and shapes errors.

- `/v1/...` and the rollout routes: a client API key (`Authorization: Bearer`, or
  `X-Overnight-Key` where the client's Authorization is a hosted upstream's own key:
  hosted.py) when any are configured, plain or scoped (keys.py: its policies, groups and
  limits); `/health` never needs one.
- `/metrics`: open like `/health` (bounded labels: no prompt, key or id), or the metrics
  token when one is set (a scraper's own; the admin token is accepted too).
- `/admin/...` and the web view at `/ui`: the admin token when one is set, else
  loopback clients only. A browser brings the token once as `/ui?token=`, which the
  view turns into a cookie; the cookie (or a bearer header) carries it from then on.
  A per-policy admin token (the keys file's `[[admin]]`) may read, promote and roll back
  the adapters of its policy (`?policy=`, absent: the default one) and nothing else,
  loopback or not: it promotes its policy's own adapters only (alias/ownership.py)
  and reads what its night needs (admin.py). The handlers know it by `POLICY_TOKEN`.

Overnight's own requests (`X-Rollout-Origin: eval`, ...; storage/read/sent_by.py) are
recorded as its own only when the operator sent them, by the rule of the admin API: with
an admin token, `X-Rollout-Origin-Token` carries it; without one, from loopback; never
under a scoped key. Any other request is recorded as `client`, header or not
(`SENT_BY`), so a client can neither hide its traffic nor change what trains.

Secrets are compared with `hmac.compare_digest`, so an answer's timing says nothing
about how much of a guess was right. The web view's cookie holds a random session id
(never the token), `Secure` when the proxy is served over TLS.

Browsers: the admin API, rewards, finishes and /ui refuse a `Host` the proxy is not
served as (DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1)
where a browser needs no credential to reach them (`rebindable`);
every state-changing request with an `Origin` that is not the proxy's own is refused
(SDKs send none); the JSON endpoints among them take a JSON content type only (a
cross-site form can send text/plain, never application/json, without asking first).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from overnight.config import ProxyConfig
from overnight.config.keys import PolicyToken, policy_names
from overnight.errors import OvernightError
from overnight.proxy.capture.attribution import ORIGIN_HEADER, ORIGIN_TOKEN_HEADER
from overnight.storage import new_id
from overnight.storage.read.sent_by import CLIENT, KINDS
from overnight.view.web import COOKIE as VIEW_COOKIE

from .hosted import PROXY_KEY_HEADER, separate_proxy_key
from .keys import KEY, KeyRing, check_path

log = logging.getLogger("overnight.proxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What aiohttp's own HTTP errors become, as OpenAI error codes.
HTTP_CODES = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}
# Paths a browser page must not reach by rebinding or from another site.
BROWSER_GUARDED = ("/admin/", "/ui", "/v1/rollouts/")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 1024
# What a per-policy admin token may do, on its own policy only.
POLICY_ADMIN = frozenset(
    {
        ("GET", "/admin/adapters"),
        ("HEAD", "/admin/adapters"),
        ("POST", "/admin/adapters/promote"),
        ("POST", "/admin/adapters/rollback"),
        ("POST", "/admin/handover"),  # its policy's share served locally (handover.py)
    }
)
# Set on a request a per-policy admin token made: the handlers limit what it may name and see.
POLICY_TOKEN = web.RequestKey("overnight_policy_token", PolicyToken)
# Set on a completion the operator sent for overnight itself: what of it (absent: `client`).
SENT_BY = web.RequestKey("overnight_sent_by", str)


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer ...` header, or None without one."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def _secret(text: str) -> bytes:
    # compare_digest takes str only when ASCII; a header may carry anything.
    return text.encode("utf-8", "surrogatepass")


class Access:
    """The proxy's keys, encoded once; `check` raises unless the request may pass."""

    def __init__(self, config: ProxyConfig, keys: KeyRing | None = None):
        self.keys = KeyRing(config) if keys is None else keys
        self.policy_tokens = tuple((bytes.fromhex(t.sha256), t) for t in config.policy_tokens)
        self.default_policy = policy_names(config)[0]
        self.admin_token = None if config.admin_token is None else _secret(config.admin_token)
        self.metrics_token = None if config.metrics_token is None else _secret(config.metrics_token)
        # The client's Authorization may be a hosted upstream's key: ours then has its own
        # header (routes/hosted.py).
        self.separate_key = separate_proxy_key(config)
        self.sessions: OrderedDict[str, float] = OrderedDict()  # web view: id -> expiry

    def check(self, request: web.Request, path: str) -> bool:
        """Raise unless the request may pass; True when it opens a web-view session."""
        if path.startswith(("/admin/", "/ui")):
            return self._check_admin(request, path)
        if path == "/metrics":
            self._check_metrics(request)
            return False
        if self.keys.required and path != "/health":
            token = request.headers.get(PROXY_KEY_HEADER) if self.separate_key else bearer(request)
            matched, scoped = self.keys.match(token)
            if not matched:
                raise OvernightError(
                    "missing or incorrect API key", status=401, code="invalid_api_key"
                )
            if scoped is not None:
                check_path(request, scoped, path)
                request[KEY] = scoped  # the handlers scope by it; the guard limits it
        if ORIGIN_HEADER in request.headers:  # one lookup for every other request
            self._sent_by(request)
        return False

    def _sent_by(self, request: web.Request) -> None:
        """Overnight's own request, when the operator sent it (the module's docstring);
        an unknown kind from the operator is refused (a typo would record it as a client's)."""
        kind = request.headers[ORIGIN_HEADER].strip().lower()
        if request.get(KEY) is not None:  # a scoped key is a client's, loopback or not
            return
        if self.admin_token is None:
            operator = is_loopback(request.remote)
        else:
            token = request.headers.get(ORIGIN_TOKEN_HEADER)
            operator = token is not None and self._is_admin_token(token)
        if not operator or kind == CLIENT:
            return
        if kind not in KINDS:
            raise OvernightError(
                f"{ORIGIN_HEADER} must be one of {sorted(KINDS)}, got {kind!r:.40}",
                status=400,
                code="invalid_origin",
            )
        request[SENT_BY] = kind

    def _check_admin(self, request: web.Request, path: str) -> bool:
        if self.admin_token is None:
            # A policy's token is held to its policy on loopback too: its night's view.
            if not self._policy_admin(request, path) and not is_loopback(request.remote):
                raise OvernightError(
                    "the admin API and web view answer loopback clients only unless an admin token is set",
                    status=403,
                    code="admin_forbidden",
                )
            return False
        token = bearer(request)
        if token is None and path.startswith("/ui"):  # a browser: the query once, then the cookie
            if self._in_session(request.cookies.get(VIEW_COOKIE)):
                return False
            token = request.query.get("token")
            if token is not None and self._is_admin_token(token):
                return True
        if token is None or not self._is_admin_token(token):
            if self._policy_admin(request, path):
                return False
            raise OvernightError(
                "missing or wrong admin token", status=401, code="invalid_admin_token"
            )
        return False

    def _policy_admin(self, request: web.Request, path: str) -> bool:
        """True when the bearer is a per-policy admin token and the request is one it may
        make; 403 when it is one and the request is not; False when it is none."""
        token = bearer(request)
        if token is None or not self.policy_tokens:
            return False
        digest = hashlib.sha256(_secret(token)).digest()
        found = None
        for key, spec in self.policy_tokens:  # every one compared, as for client keys
            if hmac.compare_digest(digest, key):
                found = spec
        if found is None:
            return False
        asked = request.query.getall("policy", [self.default_policy])
        if (request.method, path) in POLICY_ADMIN and asked == [found.policy]:
            request[POLICY_TOKEN] = found
            return True
        raise OvernightError(
            f"admin token {found.name!r} may read, promote and roll back the adapters of "
            f"policy {found.policy!r} only (?policy={found.policy})",
            status=403,
            code="admin_forbidden",
        )

    def _check_metrics(self, request: web.Request) -> None:
        token = bearer(request)
        if self.metrics_token is None or (token is not None and self._is_metrics_token(token)):
            return
        raise OvernightError("missing or wrong metrics token", status=401, code="invalid_token")

    def _is_metrics_token(self, token: str) -> bool:
        given = _secret(token)  # both compared: the time does not say which matched
        matched = hmac.compare_digest(given, self.metrics_token)
        if self.admin_token is not None:
            matched |= hmac.compare_digest(given, self.admin_token)
        return matched

    def _is_admin_token(self, token: str) -> bool:
        return hmac.compare_digest(_secret(token), self.admin_token)

    def _in_session(self, session: str | None) -> bool:
        expiry = None if session is None else self.sessions.get(session)
        return expiry is not None and expiry > time.monotonic()

    def open_session(self, request: web.Request, response: web.StreamResponse) -> None:
        """A random id in the cookie, remembered here; the token itself never leaves."""
        session = secrets.token_urlsafe(32)
        self.sessions[session] = time.monotonic() + SESSION_SECONDS
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        response.set_cookie(
            VIEW_COOKIE,
            session,
            httponly=True,
            samesite="Strict",
            path="/ui",
            secure=request.secure or None,
            max_age=SESSION_SECONDS,
        )


class Hosts:
    """The `Host` names the proxy is served as: the configured ones, loopback names, this
    machine's name, and any IP address (a page cannot rebind a name it does not own)."""

    def __init__(self, allowed: tuple[str, ...]):
        self.any = "*" in allowed
        names = {_host_name(h) for h in allowed if h != "*"}
        self.names = names | LOOPBACK_NAMES | {socket.gethostname().lower()}
        self._known: dict[str, bool] = {}  # Host header -> verdict; bounded

    def allows(self, host: str) -> bool:
        verdict = self._known.get(host)
        if verdict is None:
            name = _host_name(host)
            verdict = self.any or name in self.names or name.endswith(".localhost") or _is_ip(name)
            if len(self._known) < 1024:
                self._known[host] = verdict
        return verdict


def _host_name(host: str) -> str:
    """`Example.com:8000` -> `example.com`, `[::1]:8000` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def rebindable(config: ProxyConfig) -> tuple[str, ...]:
    """The guarded paths whose access a browser has just by being on this machine: the
    admin API and /ui with no admin token (loopback is trusted), rewards and finishes
    with no API keys. With a token or keys a rebound page has nothing to send: browsers
    attach neither a bearer token nor, to evil.example, the view's cookie."""
    no_token, no_keys = config.admin_token is None, not (config.api_keys or config.keys)
    return tuple(
        p
        for p, ambient in zip(BROWSER_GUARDED, (no_token, no_token, no_keys), strict=True)
        if ambient
    )


def check_browser(
    request: web.Request, path: str, hosts: Hosts, rebind: tuple[str, ...] = BROWSER_GUARDED
) -> None:
    """Refuse what only a browser page on another site (or a rebound name) would send.
    A completion costs two prefix tests and one header lookup (no `Origin`: an SDK)."""
    guarded = path.startswith(BROWSER_GUARDED)
    if guarded and path.startswith(rebind):
        host = request.headers.get("Host")
        if host is not None and not hosts.allows(host):
            raise OvernightError(
                f"Host {host!r:.100} is not a name this proxy is served as "
                "(serve it with --allowed-host NAME)",
                status=403,
                code="host_not_allowed",
            )
    if request.method in SAFE_METHODS:
        return
    origin = request.headers.get("Origin")
    if origin is not None and not _own_origin(origin, request.headers.get("Host"), hosts):
        raise OvernightError(
            f"cross-origin request from {origin!r:.100} refused",
            status=403,
            code="cross_origin_forbidden",
        )
    if guarded and request.body_exists and not _is_json_type(request.content_type):
        raise OvernightError(
            f"expected a JSON body (Content-Type: application/json), got {request.content_type!r:.100}",
            status=415,
            code="unsupported_media_type",
        )


def _own_origin(origin: str, host: str | None, hosts: Hosts) -> bool:
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    return host is not None and netloc.lower() == host.lower() and hosts.allows(host)


def _is_json_type(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


def error_response(exc: OvernightError) -> web.Response:
    retry_after = getattr(exc, "retry_after", None)  # a 503 during maintenance, a 429
    headers = dict(getattr(exc, "headers", None) or {})  # a 429's x-ratelimit-*
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(exc.body(), status=exc.status, headers=headers or None)


def make_guard(config: ProxyConfig, keys: KeyRing | None = None):
    """The app's middleware: authenticate, refuse cross-site requests, and turn every
    error the proxy makes into OpenAI-shaped JSON, unexpected ones included.

    One middleware rather than two: each layer costs a coroutine per request. A closure
    over the config: no app lookup per request, and it serves the web view's
    sub-application too, whose own `request.app` holds none of the proxy's keys.
    `keys`: the app's KeyRing (its counts are /admin/stats'); else one of its own.
    """
    access = Access(config, keys)
    hosts = Hosts(config.allowed_hosts)
    rebind = rebindable(config)
    too_large = f"request body is larger than the limit of {config.max_body_bytes} bytes"

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            path = request.path
            new_session = access.check(request, path)
            check_browser(request, path, hosts, rebind)
            key = request.get(KEY)
            if key is None:
                response = await handler(request)
            else:  # a scoped key: its rate and concurrency (keys.py)
                key.admit(request)
                try:
                    response = await handler(request)
                finally:
                    key.leave()
            if new_session:
                access.open_session(request, response)
            return response
        except OvernightError as e:
            return error_response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = too_large if e.status == 413 else e.text
            code = HTTP_CODES.get(e.status, "http_error")
            return error_response(OvernightError(message, status=e.status, code=code))
        except Exception:
            # One catch-all: a bug answers 500 JSON naming the request, and the log has
            # its traceback under the same id. (Completions also leave a record:
            # agent_api.completions.)
            request_id = new_id()
            log.exception("%s %s failed (request id %s)", request.method, request.path, request_id)
            return error_response(
                OvernightError(
                    f"the proxy failed on this request (request id {request_id})",
                    status=500,
                    code="internal_error",
                )
            )

    return guard
