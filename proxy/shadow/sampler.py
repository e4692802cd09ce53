"""Shadow sampling: K more samples of a served turn, asked for once its answer was sent.

Production agents make one call per step, so their turns form groups of one and GRPO
has nothing to compare. With `--shadow-samples K` the proxy asks vLLM, after a served
turn's answer has been written to the client, for K siblings of it: the exact logged
context (the prompt token ids vLLM reported, sent as a token-id prompt to
/v1/completions), the turn's sampling parameters, the adapter that served it, n=K,
logprobs and token ids, at low priority. They are stored as siblings of the served
choice (never shown to the agent); the served choice and its siblings are a group.

Bounded so that serving never waits on it: `offer` only puts the turn on a queue of
`--shadow-queue` (a full queue drops the turn and counts it), `--shadow-concurrency`
workers send the requests, and nothing here can raise into a request handler. Served
traffic comes first twice over: vLLM's priority orders what waits in its queue, and
the proxy sends a sibling request only while the replica has at most
`--shadow-max-served` served requests in flight (0: none), and has had so for
`--shadow-quiet` seconds with no served turn answered meanwhile (an agent's next call
often follows its answer within moments), cancelling it (vLLM aborts on the closed
connection) and trying again later when more arrive meanwhile. A served request counts
from the moment the proxy accepts it (`accept`, before its body is read), and its
arrival wakes a running sibling request at once.

vLLM facts (0.32, read in its source and measured, see /admin/stats and BENCHMARKS.md):
- `priority` (request field, or the `X-Vllm-Priority` header) orders the waiting queue
  (lower first) and picks the victim of a preemption under KV-cache pressure, but only
  with `--scheduling-policy priority`; under the default fcfs it is accepted and
  ignored. It never pauses a running request: once admitted, a sibling shares each
  batch step with the served requests (on a CPU, every sequence makes the step
  longer), which is what the proxy's own yielding is for.
- /v1/completions is cancelled when its client disconnects, but a whole (non-streamed)
  response notices only when vLLM next polls for the disconnect, so its K sequences
  kept decoding in the served requests' batches (BENCHMARKS.md, shadow sampling, run
  6: served p99 1.47x). A streamed one is aborted as soon as vLLM's server sees the
  connection close (uvicorn reports ASGI 2.3, so starlette listens for the disconnect
  and cancels the stream): 2.2 ms after the proxy's cancel at the median, measured
  with `bench/shadow_latency.py --vllm-log`. Sibling requests are streamed, and
  assembled back into the whole response's shape (proxy/shadow/stream.py; the nightly
  stage asks for whole ones).
- What cost served requests was when siblings started, not vLLM: started the instant
  an answer was written, a sibling competed on a CPU upstream's cores with that
  answer's delivery, and with a served request already read but not yet forwarded
  (`replica.outstanding` counts from the forward; hence `accept`). `--shadow-quiet`
  (0.02 s) waits past the first; a sibling cancelled as a served request arrives costs
  it nothing at the median (bench/shadow_collision.py).
- /v1/completions takes a token-id list as `prompt` and returns it per choice as
  `prompt_token_ids` with `return_token_ids`. Its unset `max_tokens` is 16 (the chat
  endpoint's: the rest of the context), and a `max_tokens` above `max_model_len` is
  refused with a 400, so a chat turn without a limit gets the context left, from the
  model's card in /v1/models (an adapter's card has no length: its parent's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import asdict, dataclass

import aiohttp
import orjson
from aiohttp import web

from overnight.config import ConfigError, ProxyConfig
from overnight.proxy.capture.captures import GroupRollouts
from overnight.proxy.capture.chat import CHAT
from overnight.proxy.capture.redact import Redactor
from overnight.proxy.forward.balancer import Balancer, Replica
from overnight.proxy.forward.jsonio import json_dumps
from overnight.storage import LogWriter, now_us
from overnight.storage.read.sent_by import CLIENT
from overnight.storage.read.siblings import TABLE as SIBLINGS
from overnight.storage.read.siblings import (
    SiblingError,
    completion_request,
    context_lengths,
    resample_unsupported,
    sibling_rows,
)

from .stream import assemble_stream

log = logging.getLogger("overnight.proxy")

# A running sibling request is woken the moment a served request is accepted
# (`accept`); it also looks at its replica this often, for a served request that was
# accepted while another replica was still a choice and routed to its replica later.
WATCH_S = 0.01
# How often a sibling request waiting for its replica to be quiet looks again.
WAIT_S = 0.01
# Tries of a turn whose sibling request served traffic cancelled; then it is given up.
ATTEMPTS = 3
# A file to write a JSON line per sibling request event to (time.monotonic(), shared by
# every process on the machine): bench/shadow_latency.py reads it to tell what was in
# flight when a served request was slow. A diagnostic, not an option.
TRACE_ENV = "OVERNIGHT_SHADOW_TRACE"


@dataclass(slots=True)
class ShadowStats:
    """What /admin/stats reports under "shadow"."""

    offered: int = 0  # turns recorded while shadow sampling was on
    eligible: int = 0  # of them: one complete choice, token ids logged, in no group of 2+
    sampled: int = 0  # of them: chosen by --shadow-rate and queued
    dropped: int = 0  # chosen, but the queue was full
    requests: int = 0  # turns whose siblings were asked for
    failed: int = 0  # of them: an error, a timeout, an answer that does not fit, or
    # served requests arriving during every attempt
    preempted: int = 0  # attempts cancelled because served requests arrived (retried)
    siblings: int = 0  # sibling rows stored
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class ShadowJob:
    """One served turn to sample again: its completions row (a mapping, as
    storage.siblings reads it) and the balancer's key for it."""

    served: dict
    # The rollout's id: the replica that served the turn and has its prefix cached. A
    # turn without one goes where its record id hashes (it never changes between tries).
    key: str


def sibling_request(
    served: dict, samples: int, priority: int, max_model_len: int | None = None
) -> dict:
    """The /v1/completions body that asks for `samples` siblings of a served turn: the
    resampling stage's body (storage.siblings: token-id prompt, the turn's sampling
    parameters, its adapter), at low priority. Without a limit the chat endpoint gave
    the served turn the rest of the context (`max_model_len` less the prompt), text
    completions 16, which /v1/completions gives too."""
    chat = served["endpoint"] == CHAT
    body = completion_request(served, samples, max_model_len=max_model_len if chat else None)
    if chat and "max_tokens" not in body:
        raise SiblingError("the model's context length is unknown (vLLM lists no card for it)")
    body["priority"] = priority
    # Streamed so that a cancelled request stops at once: vLLM 0.32 aborts a stream at
    # its next write after the client left, a whole response only when it next polls.
    body["stream"] = True
    return body


class ShadowSampler:
    """The queue of turns to sample and the workers that ask vLLM for their siblings."""

    def __init__(
        self,
        config: ProxyConfig,
        balancer: Balancer,
        redactor: Redactor,
        rng: random.Random | None = None,
    ):
        self.samples = config.shadow_samples
        self.rate = config.shadow_rate
        self.concurrency = config.shadow_concurrency
        self.priority = config.shadow_priority
        self.max_served = config.shadow_max_served
        if config.shadow_quiet < 0:
            raise ConfigError(f"shadow_quiet must be >= 0 seconds, got {config.shadow_quiet}")
        self.quiet = config.shadow_quiet
        self.answered = 0.0  # loop time of the last served turn's answer (any turn)
        self.timeout = config.read_timeout
        self.balancer = balancer
        self.redactor = redactor
        self.headers = {"Content-Type": "application/json"}
        if config.upstream_api_key:
            self.headers["Authorization"] = f"Bearer {config.upstream_api_key}"
        self.rng = rng or random.Random()
        self.groups = GroupRollouts()
        self.stats = ShadowStats()
        self.queue: asyncio.Queue[ShadowJob] = asyncio.Queue(config.shadow_queue)
        self.writer: LogWriter | None = None
        self.workers: list[asyncio.Task] = []
        self.mine: dict[Replica, int] = {}  # our requests outstanding, per replica
        self.accepted = 0  # served completions in the proxy's handlers (`accept`)
        self._arrival: asyncio.Future[None] | None = None  # resolved by the next `accept`
        self.context: dict[str, int | None] = {}  # model name -> max_model_len (/v1/models)
        self.session: aiohttp.ClientSession | None = None  # for /v1/models, made on first use
        self._warned = False
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self.samples > 0

    def start(self, writer: LogWriter) -> None:
        self.writer = writer
        if self.enabled:
            self.workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
        if self._trace is not None:
            self.workers.append(asyncio.create_task(self._watch_loop()))

    async def _watch_loop(self) -> None:
        """Traced only: the event loop's stalls (a 5 ms sleep that took 10 ms more), when
        no served request nor sibling could make progress in this proxy."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            late = loop.time() - t - 0.005
            if late > 0.010:
                self._event("stall", "", ms=round(late * 1000, 1))

    async def close(self) -> None:
        """Stops the workers; a sibling request in flight is abandoned (its connection
        closed, so vLLM stops generating), queued turns are dropped."""
        for task in self.workers:
            task.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        self.workers = []
        if self.session is not None:
            await self.session.close()
        if self._trace is not None:
            self._trace.close()

    def snapshot(self) -> dict:
        return {
            "enabled": self.enabled,
            "samples": self.samples,
            "rate": self.rate,
            **asdict(self.stats),
            "queued": self.queue.qsize(),
            "accepted": self.accepted,  # served completions in the proxy now
        }

    # -- the request side ---------------------------------------------------------------

    def accept(self) -> None:
        """A served completion was accepted (its body not read yet): it counts as served
        from now, and a running sibling request is woken to give way."""
        self.accepted += 1
        arrival, self._arrival = self._arrival, None
        if arrival is not None and not arrival.done():
            arrival.set_result(None)

    def release(self) -> None:
        """The served completion `accept` counted has ended (answered, failed or left)."""
        self.accepted -= 1

    def _next_arrival(self) -> asyncio.Future[None]:
        if self._arrival is None:
            self._arrival = asyncio.get_running_loop().create_future()
        return self._arrival

    def offer(self, rows: list[dict]) -> None:
        """Queue a served turn (its completions rows, as written) for sampling if it
        qualifies. Called once the answer was written to the client (the record is built
        then); never raises, never waits."""
        if not self.enabled or not self.workers:  # off, or not started
            return
        self.answered = asyncio.get_running_loop().time()
        try:
            job = self._job(rows)
        except Exception:  # a row of a shape not foreseen: the served turn must not notice
            log.exception("shadow sampling: could not read a served row")
            return
        if job is None or self.rng.random() >= self.rate:
            return
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return
        self.stats.sampled += 1

    def _job(self, rows: list[dict]) -> ShadowJob | None:
        self.stats.offered += 1
        if len(rows) != 1:  # n > 1: the choices are a group already
            return None
        (row,) = rows
        grouped = row["group_id"] != row["rollout_id"]  # else a group of one by its ids
        if grouped and self.groups.add(row["group_id"], row["rollout_id"]) > 1:
            return None  # a group of two or more rollouts
        if not row["logged"] or resample_unsupported(row) is not None:
            return None
        if row.get("sent_by", CLIENT) != CLIENT:  # overnight's own turn: never trained
            return None
        self.stats.eligible += 1
        key = row["rollout_id"] if row["attribution"] != "none" else row["record_id"]
        return ShadowJob(row, key)

    # -- the workers ----------------------------------------------------------------------

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            self.stats.in_flight += 1
            self.stats.requests += 1
            try:
                rows = await self._sample(job)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # whatever it was, the next turn is tried
                self.stats.failed += 1
                self._warn(job, e)
            else:
                self._store(rows)
                self._event("stored", job.key)
            finally:
                self.stats.in_flight -= 1

    async def _sample(self, job: ShadowJob) -> list[dict]:
        """K siblings of the turn as `siblings` rows. A failure is only counted: no error
        row, so the nightly stage may still resample the turn."""
        context = await self._context_length(job)
        sent = sibling_request(job.served, self.samples, self.priority, context)
        data = json_dumps(sent)
        started = now_us()
        for _ in range(ATTEMPTS):
            answer = await self._attempt(job.key, data)
            if answer is not None:
                break
            self.stats.preempted += 1
        else:
            raise SiblingError(f"served requests arrived during each of {ATTEMPTS} attempts")
        if len(answer["choices"]) != self.samples:
            raise SiblingError(f"asked for {self.samples} siblings, got another number")
        assert self.writer is not None
        return sibling_rows(
            job.served,
            answer,
            origin="shadow",
            writer_id=self.writer.writer_id,
            started_at=started,
            ended_at=now_us(),
            sent=sent,
        )

    async def _attempt(self, key: str, data: bytes) -> dict | None:
        """One sibling request, sent once its replica is quiet enough: the whole response
        assembled from its stream, or None when served requests arrived meanwhile and it
        was cancelled (closing the connection makes vLLM stop generating it)."""
        replica = self.balancer.pick(key)
        assert replica is not None
        await self._quiet(replica)
        call = asyncio.ensure_future(self._call(replica, key, data))
        try:
            while True:
                arrival = self._next_arrival()
                await asyncio.wait([call, arrival], timeout=WATCH_S, return_when="FIRST_COMPLETED")
                if call.done():
                    self._event("done", key)
                    return call.result()
                if self._served(replica) > self.max_served:
                    self._event("cancel", key, served=self._served(replica))
                    return None
        finally:
            call.cancel()  # a no-op once it is done

    async def _quiet(self, replica: Replica) -> None:
        """Returns once `replica` has had at most `max_served` served requests in flight
        for `quiet` seconds, no served turn answered meanwhile (at once when quiet is 0
        and the replica is free enough)."""
        loop = asyncio.get_running_loop()
        since: float | None = None  # since when the replica has been free enough
        while True:
            now = loop.time()
            if self._served(replica) > self.max_served:
                since = None
            else:
                since = max(now if since is None else since, self.answered)
                if now - since >= self.quiet:
                    return
            await asyncio.sleep(WAIT_S)

    async def _call(self, replica: Replica, key: str, data: bytes) -> dict:
        self.mine[replica] = self.mine.get(replica, 0) + 1
        self._event("send", key)
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.balancer.post("/v1/completions", data, self.headers, key)
                if response.replica is not replica:  # the balancer failed over: ours is there
                    self.mine[replica] -= 1
                    replica = response.replica
                    self.mine[replica] = self.mine.get(replica, 0) + 1
                async with response:
                    if response.status != 200:
                        raw = await response.read()
                        raise SiblingError(f"upstream HTTP {response.status}: {raw[:200]!r}")
                    return await assemble_stream(response, lambda: self._event("first", key))
        finally:
            self.mine[replica] -= 1
            self._event("closed", key)

    async def _context_length(self, job: ShadowJob) -> int | None:
        """The served model's max_model_len, asked of vLLM once per model (again when a
        new adapter appears); every replica serves the same base model."""
        model = job.served["model_served"]
        if model not in self.context:
            replica = self.balancer.pick(job.key)
            assert replica is not None
            if self.session is None:
                self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
            async with self.session.get(replica.url + "/v1/models", headers=self.headers) as r:
                if r.status != 200:
                    raise SiblingError(f"listing vLLM's models answered HTTP {r.status}")
                self.context.update(context_lengths((await r.json()).get("data") or []))
        return self.context.get(model)

    def _served(self, replica: Replica) -> int:
        """Served requests in flight on `replica`: all it has outstanding but ours, and
        those accepted but not yet forwarded anywhere (reading their body, routing),
        which may still come to it. Where one goes is known only once its body is read
        (its rollout id may be in it), so until then it counts on every replica: with
        several, a sibling may give way to a request that goes elsewhere. A body takes
        one read on a local network; a client that sends a head and stalls holds shadow
        sampling back (`accepted` in /admin/stats), never served traffic."""
        routed = {r: max(r.outstanding - self.mine.get(r, 0), 0) for r in self.balancer.replicas}
        unrouted = self.accepted - sum(routed.values())
        return routed.get(replica, 0) + max(unrouted, 0)

    def _event(self, event: str, key: str, **extra: object) -> None:
        if self._trace is not None:
            line = {"t": time.monotonic(), "event": event, "key": key, **extra}
            self._trace.write(orjson.dumps(line).decode() + "\n")

    def _store(self, rows: list[dict]) -> None:
        assert self.writer is not None
        # Siblings hold what the model said too: the user's --redact hook sees them.
        for row in self.redactor.apply(rows):
            self.writer.append(SIBLINGS, row)
        self.stats.siblings += len(rows)

    def _warn(self, job: ShadowJob, error: BaseException) -> None:
        # Once at warning, then at debug: a down upstream must not flood the log.
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(
            level,
            "shadow sampling of record %s failed (%s); counted in /admin/stats",
            job.served["record_id"],
            _describe(error),
        )


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    if isinstance(error, aiohttp.ClientError):
        return f"upstream unreachable: {error!r}"
    return str(error) or repr(error)


SHADOW = web.AppKey("shadow", ShadowSampler)
