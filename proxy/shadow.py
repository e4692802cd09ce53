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
`--shadow-max-served` served requests in flight (0: none), cancelling it (vLLM aborts
on the closed connection) and trying again later when more arrive meanwhile.

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
  6: served p99 1.47x). A streamed one is aborted at its next write after the client
  left, a step later: sibling requests are streamed, and assembled back into the whole
  response's shape here (`assemble_stream`; the nightly stage asks for whole ones).
- /v1/completions takes a token-id list as `prompt` and returns it per choice as
  `prompt_token_ids` with `return_token_ids`. Its unset `max_tokens` is 16 (the chat
  endpoint's: the rest of the context), and a `max_tokens` above `max_model_len` is
  refused with a 400, so a chat turn without a limit gets the context left, from the
  model's card in /v1/models (an adapter's card has no length: its parent's).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import asdict, dataclass

import aiohttp
import orjson
from aiohttp import web

from overnight.config import ProxyConfig
from overnight.storage import LogWriter, now_us
from overnight.storage.siblings import TABLE as SIBLINGS
from overnight.storage.siblings import (
    SiblingError,
    completion_request,
    context_lengths,
    resample_unsupported,
    sibling_rows,
)

from .balancer import Balancer, Replica
from .capture import CHAT
from .capture_state import GroupRollouts
from .jsonio import json_dumps
from .redact import Redactor
from .sse import SSEParser

log = logging.getLogger("overnight.proxy")

# How often a running sibling request looks at its replica's served requests: the
# longest a served request shares the replica with it, before vLLM's abort (a step).
WATCH_S = 0.002
# How often a sibling request waiting for its replica to be quiet looks again.
WAIT_S = 0.01
# Tries of a turn whose sibling request served traffic cancelled; then it is given up.
ATTEMPTS = 3


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


async def assemble_stream(response) -> dict:
    """The whole /v1/completions response (the `choices` that storage.siblings reads)
    from vLLM's stream of it, read from `response.content.iter_any()` (an aiohttp
    response or the proxy's own upstream one).

    vLLM 0.32 (read in its serving code and checked against its whole answer, seeded:
    tests/test_shadow.py) sends one choice per chunk, the choices of n > 1 interleaved
    by `index`; a chunk has the choice's new text, `token_ids` and `logprobs`
    (`token_logprobs`, one per new token), its first also the `prompt_token_ids` (with
    `return_token_ids`), its last the `finish_reason`; `stream_options` add only usage,
    not needed. An `{"error": ...}` event or a stream cut before `[DONE]` raises
    SiblingError."""
    choices: dict[int, dict] = {}
    parser = SSEParser()
    async for chunk in response.content.iter_any():
        for raw in parser.feed(chunk):
            payload = SSEParser.data_of(raw)
            if payload is None:
                continue
            if payload == b"[DONE]":
                return {"choices": [_whole_choice(choices[i]) for i in sorted(choices)]}
            event = orjson.loads(payload)
            if "error" in event:
                raise SiblingError(f"vLLM failed mid-stream: {str(event['error'])[:200]}")
            for part in event.get("choices") or ():
                _add_part(choices.setdefault(part["index"], _empty_choice(part["index"])), part)
    raise SiblingError("the stream ended before [DONE]")


def _empty_choice(index: int) -> dict:
    return {"index": index, "text": [], "token_ids": [], "token_logprobs": [], "prompt": None}


def _add_part(choice: dict, part: dict) -> None:
    choice["text"].append(part.get("text") or "")
    choice["token_ids"].extend(part.get("token_ids") or ())
    # A chunk without logprobs leaves the choice one short: sibling_rows refuses it.
    choice["token_logprobs"].extend((part.get("logprobs") or {}).get("token_logprobs") or ())
    if part.get("prompt_token_ids") is not None:
        choice["prompt"] = part["prompt_token_ids"]
    if part.get("finish_reason") is not None:
        choice["finish_reason"] = part["finish_reason"]


def _whole_choice(choice: dict) -> dict:
    if choice["prompt"] is None:  # else sibling_rows could not check the context
        raise SiblingError("vLLM streamed a choice without its prompt_token_ids")
    return {
        "index": choice["index"],
        "text": "".join(choice["text"]),
        "token_ids": choice["token_ids"],
        "logprobs": {"token_logprobs": choice["token_logprobs"]},
        "finish_reason": choice.get("finish_reason"),
        "prompt_token_ids": choice["prompt"],
    }


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
        self.context: dict[str, int | None] = {}  # model name -> max_model_len (/v1/models)
        self.session: aiohttp.ClientSession | None = None  # for /v1/models, made on first use
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.samples > 0

    def start(self, writer: LogWriter) -> None:
        self.writer = writer
        if self.enabled:
            self.workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]

    async def close(self) -> None:
        """Stops the workers; a sibling request in flight is abandoned (its connection
        closed, so vLLM stops generating), queued turns are dropped."""
        for task in self.workers:
            task.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        self.workers = []
        if self.session is not None:
            await self.session.close()

    def snapshot(self) -> dict:
        return {
            "enabled": self.enabled,
            "samples": self.samples,
            "rate": self.rate,
            **asdict(self.stats),
            "queued": self.queue.qsize(),
        }

    # -- the request side: called once a served turn's rows are built -------------------

    def offer(self, rows: list[dict]) -> None:
        """Queue a served turn (its completions rows, as written) for sampling if it
        qualifies. Called once the answer was written to the client (the record is built
        then); never raises, never waits."""
        if not self.workers:  # off, or not started
            return
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
        while self._served(replica) > self.max_served:
            await asyncio.sleep(WAIT_S)
        call = asyncio.ensure_future(self._call(replica, key, data))
        try:
            while True:
                done, _ = await asyncio.wait([call], timeout=WATCH_S)
                if done:
                    return call.result()
                if self._served(replica) > self.max_served:
                    return None
        finally:
            call.cancel()  # a no-op once it is done

    async def _call(self, replica: Replica, key: str, data: bytes) -> dict:
        self.mine[replica] = self.mine.get(replica, 0) + 1
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.balancer.post("/v1/completions", data, self.headers, key)
                async with response:
                    if response.status != 200:
                        raw = await response.read()
                        raise SiblingError(f"upstream HTTP {response.status}: {raw[:200]!r}")
                    return await assemble_stream(response)
        finally:
            self.mine[replica] -= 1

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
        """Served requests in flight on `replica`: all it has outstanding but ours."""
        return replica.outstanding - self.mine.get(replica, 0)

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
