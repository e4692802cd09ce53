"""Who may call what, and the one middleware that enforces it and shapes errors.

- `/v1/...` and the rollout routes: a client API key (`Authorization: Bearer`) when any
  are configured; `/health` never needs one.
- `/admin/...` and the web view at `/ui`: the admin token when one is set, else
  loopback clients only. A browser brings the token once as `/ui?token=`, which the
  view turns into a cookie; the cookie (or a bearer header) carries it from then on.

Secrets are compared with `hmac.compare_digest`, so an answer's timing says nothing
about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web

from overnight.config import ProxyConfig
from overnight.errors import OvernightError
from overnight.view.web import COOKIE as VIEW_COOKIE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What aiohttp's own HTTP errors become, as OpenAI error codes.
HTTP_CODES = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}


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

    def __init__(self, config: ProxyConfig):
        self.api_keys = tuple(_secret(k) for k in config.api_keys)
        self.admin_token = None if config.admin_token is None else _secret(config.admin_token)

    def check(self, request: web.Request) -> None:
        path = request.path
        if path.startswith(("/admin/", "/ui")):
            self._check_admin(request, path)
        elif self.api_keys and path != "/health" and not self._is_api_key(bearer(request)):
            raise OvernightError("missing or incorrect API key", status=401, code="invalid_api_key")

    def _check_admin(self, request: web.Request, path: str) -> None:
        if self.admin_token is None:
            if not is_loopback(request.remote):
                raise OvernightError(
                    "the admin API and web view answer loopback clients only unless an admin token is set",
                    status=403,
                    code="admin_forbidden",
                )
            return
        token = bearer(request)
        if token is None and path.startswith("/ui"):  # a browser: the query once, then the cookie
            token = request.query.get("token") or request.cookies.get(VIEW_COOKIE)
        if token is None or not hmac.compare_digest(_secret(token), self.admin_token):
            raise OvernightError(
                "missing or wrong admin token", status=401, code="invalid_admin_token"
            )

    def _is_api_key(self, token: str | None) -> bool:
        if token is None:
            return False
        given = _secret(token)
        matched = False
        for key in self.api_keys:  # every key compared: the time does not say which matched
            matched |= hmac.compare_digest(given, key)
        return matched


def error_response(exc: OvernightError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def make_guard(config: ProxyConfig):
    """The app's middleware: authenticate, and turn every error the proxy makes into
    OpenAI-shaped JSON.

    One middleware rather than two: each layer costs a coroutine per request. A closure
    over the config: no app lookup per request, and it serves the web view's
    sub-application too, whose own `request.app` holds none of the proxy's keys.
    """
    access = Access(config)
    too_large = f"request body is larger than the limit of {config.max_body_bytes} bytes"

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            access.check(request)
            return await handler(request)
        except OvernightError as e:
            return error_response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = too_large if e.status == 413 else e.text
            code = HTTP_CODES.get(e.status, "http_error")
            return error_response(OvernightError(message, status=e.status, code=code))

    return guard
