"""OpenTelemetry traces: the one place that decides whether they are on, and builds them.

Off unless the standard variables say where to send them (`OTEL_EXPORTER_OTLP_ENDPOINT`
or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), or Langfuse's do (`LANGFUSE_PUBLIC_KEY`,
`LANGFUSE_SECRET_KEY` and `LANGFUSE_HOST`, or its newer name `LANGFUSE_BASE_URL`: then
the exporter posts to `{host}/api/public/otel/v1/traces` with Basic auth). Off costs
nothing: `from_environment` returns None without importing the SDK, and every caller
checks for None before it makes a span.

On, a night's spans go OTLP over HTTP (protobuf) from a `BatchSpanProcessor`: ended
spans are queued and a thread of the SDK's exports them, so the night never waits for
the collector, and a collector that is down costs a logged warning, never a failure.
The SDK reads the rest of the standard variables itself (`OTEL_EXPORTER_OTLP_HEADERS`,
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`,
timeouts, certificates). Each run owns its `Tracing` (never the global provider). The
proxy's completion spans, one per request, take a cheaper way of their own to the same
collector (proxy/observe/otlp.py: the target and the resource come from here).

The night's spans (`night`, `phase`) live here too: the CLI, the trainer and the judge
each open theirs through the night's tracer, which a context variable carries, so no
signature between them changes and a night without tracing makes no span at all.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .errors import ConfigError

log = logging.getLogger("overnight.telemetry")

# Attribute namespaces of the semantic conventions (and Langfuse's); the rest are ours.
STANDARD = {"gen_ai", "error", "server", "session", "http", "langfuse", "user"}
SHUTDOWN_SECONDS = 5.0  # what a stop waits for the last spans; a dead collector costs this


def langfuse_target(environ: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """Langfuse's OTLP endpoint and its Basic auth header, when its three variables are
    set; None when none is. Some but not all: a warning naming the missing ones, and off
    (Langfuse's own SDK reads the same variables, and the proxy must not fail for them)."""
    public, secret = environ.get("LANGFUSE_PUBLIC_KEY"), environ.get("LANGFUSE_SECRET_KEY")
    host = environ.get("LANGFUSE_HOST") or environ.get("LANGFUSE_BASE_URL")
    if not (public or secret):
        return None
    missing = [n for n, v in [("LANGFUSE_PUBLIC_KEY", public), ("LANGFUSE_SECRET_KEY", secret),
               ("LANGFUSE_HOST (or LANGFUSE_BASE_URL)", host)] if not v]  # fmt: skip
    if missing:
        log.warning("tracing to Langfuse is off: %s not set", ", ".join(missing))
        return None
    token = base64.b64encode(f"{public}:{secret}".encode()).decode()
    return f"{host.rstrip('/')}/api/public/otel/v1/traces", {"Authorization": f"Basic {token}"}


def configured(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (cheap: no SDK import)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    standard = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    return any(environ.get(n) for n in standard) or langfuse_target(environ) is not None


class Tracing:
    """A tracer provider of our own, its tracer, and a stop with a deadline."""

    def __init__(self, provider: Any, endpoint: str):
        self.provider = provider
        self.endpoint = endpoint
        self.tracer = provider.get_tracer("overnight")

    def shutdown(self, deadline: float = SHUTDOWN_SECONDS) -> None:
        """Export what is queued, waiting at most `deadline` seconds: the SDK's own
        shutdown waits up to 30 s, and its flush has no timeout at all, so it runs on a
        thread of its own that is left behind (a daemon) if the collector does not answer."""
        worker = threading.Thread(target=self._shutdown, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(deadline)
        if worker.is_alive():
            log.warning("tracing: spans not exported within %g s were dropped", deadline)

    def _shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception:  # an exporter's failure must not fail a stop
            log.exception("tracing: the exporter failed while stopping")


def check_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Whether traces are asked for; a ConfigError if they are and cannot be sent (a
    protocol not spoken, the SDK missing), so that a start fails before anything runs."""
    environ = os.environ if environ is None else environ
    if not configured(environ):
        return False
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol.strip().lower() != "http/protobuf":
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: overnight exports traces over "
            "http/protobuf only (Langfuse takes no gRPC); unset it or set http/protobuf"
        )
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"tracing is configured (OTEL_*/LANGFUSE_* variables) but OpenTelemetry is not "
            f"installed ({e.name}): pip install 'overnight[otel]', or unset the variables"
        ) from e
    return True


def from_environment(
    service: str, environ: Mapping[str, str] | None = None, exporter: Any = None
) -> Tracing | None:
    """The `Tracing` the environment asks for, or None (then nothing is imported).
    `service` names the process when `OTEL_SERVICE_NAME` does not; `exporter` replaces
    the OTLP one (tests). `environ` decides; the SDK reads the rest from os.environ."""
    environ = os.environ if environ is None else environ
    if not check_environment(environ):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    langfuse = langfuse_only(environ)
    if exporter is None:
        # The SDK reads os.environ itself: a standard endpoint is left to it (with its
        # /v1/traces suffix rule); Langfuse's is given, with its header.
        if langfuse:
            exporter = OTLPSpanExporter(endpoint=langfuse[0], headers=langfuse[1])
        else:
            exporter = OTLPSpanExporter()
    endpoint = langfuse[0] if langfuse else getattr(exporter, "_endpoint", endpoint_of(environ))
    # shutdown_on_exit off: our owner stops it, with a deadline (Tracing.shutdown).
    provider = TracerProvider(resource=resource(service), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing: OTLP/HTTP spans to %s", endpoint)
    return Tracing(provider, endpoint)


def langfuse_only(environ: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """Langfuse's target when no standard endpoint is set (a standard one wins)."""
    standard = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return None if standard else langfuse_target(environ)


def endpoint_of(environ: Mapping[str, str]) -> str:
    """The standard endpoint, as the OTLP/HTTP exporter resolves it: the traces variable
    as given, else the general one with /v1/traces appended."""
    if traces := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return traces
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return f"{base.removesuffix('/')}/v1/traces"


def resource(service: str) -> Any:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, its detectors),
    named `service` when neither variable names it."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    found = Resource.create()
    if str(found.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        found = found.merge(Resource({SERVICE_NAME: service}))
    return found


# -- the night's spans -----------------------------------------------------------------

_NIGHT: contextvars.ContextVar[Tracing | None] = contextvars.ContextVar("night", default=None)


class Phase:
    """A span in the making: `set` adds attributes, a name of the conventions' as it is,
    any other as `overnight.NAME`; a no-op when tracing is off."""

    __slots__ = ("span",)

    def __init__(self, span: Any = None):
        self.span = span

    def set(self, **attributes: Any) -> None:
        if self.span is None:
            return
        for name, value in attributes.items():
            if value is not None:
                key = name if name.split(".", 1)[0] in STANDARD else f"overnight.{name}"
                self.span.set_attribute(key, _attribute(value))


OFF = Phase()
Describe = Callable[[Any], Mapping[str, Any]]


@contextlib.contextmanager
def night(name: str = "overnight night", environ: Mapping[str, str] | None = None):
    """One trace per night: the root span, around everything the night does. Nested in
    another (the CLI's around the trainer's), it is that one's; under torchrun only
    process 0 traces. A resumed night is a new trace (its run id says which run)."""
    environ = os.environ if environ is None else environ
    if _NIGHT.get() is not None:
        yield Phase(_current_span())
        return
    tracing = None
    if environ.get("RANK", "0") == "0":
        try:
            tracing = from_environment("overnight-train", environ)
        except ConfigError as e:  # tracing must not stop a night: said, and off
            log.warning("tracing is off for this night: %s", e)
    if tracing is None:
        yield OFF
        return
    token = _NIGHT.set(tracing)
    try:
        with _span(tracing, name) as root:
            yield root
    finally:
        _NIGHT.reset(token)
        tracing.shutdown()


@contextlib.contextmanager
def phase(name: str, **attributes: Any) -> Iterator[Phase]:
    """A child of the night's current span (plan, judge, step, gate, promotion); nothing
    at all outside a traced night."""
    tracing = _NIGHT.get()
    if tracing is None:
        yield OFF
        return
    with _span(tracing, name) as span:
        span.set(**attributes)
        yield span


def traced(name: str, describe: Describe | None = None, root: bool = False):
    """A function as a phase of the night (`root`: as the night itself); `describe` turns
    what it returned into the span's attributes. Async functions too (the judge's)."""

    def wrap(fn):
        opened = night if root else phase

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args, **kwargs):
                with opened(name) as span:
                    result = await fn(*args, **kwargs)
                    _describe(span, describe, result)
                    return result

            return run_async

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with opened(name) as span:
                result = fn(*args, **kwargs)
                _describe(span, describe, result)
                return result

        return run

    return wrap


def _describe(span: Phase, describe: Describe | None, result: Any) -> None:
    if span.span is None or describe is None:
        return
    try:
        span.set(**describe(result))
    except Exception:  # a describer's bug must not fail the phase it describes
        log.exception("tracing: could not describe a span")


@contextlib.contextmanager
def _span(tracing: Tracing, name: str) -> Iterator[Phase]:
    # The SDK records an escaping exception and marks the span failed itself.
    with tracing.tracer.start_as_current_span(name) as span:
        yield Phase(span)


def _current_span() -> Any:
    from opentelemetry import trace

    return trace.get_current_span()


def _attribute(value: Any) -> Any:
    """What an OTel attribute may hold: text, a number, a bool, or a list of one kind."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    return str(value)


def wall_ns(perf_seconds: float) -> int:
    """A `time.perf_counter()` reading as wall-clock nanoseconds (span start/end times)."""
    return time.time_ns() - int((time.perf_counter() - perf_seconds) * 1e9)
