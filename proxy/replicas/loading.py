"""An adapter onto several replicas and off them: on all or none, or where it is missing.

A new name is loaded on every target or on none (`load_on_all`: a promotion, a rollback,
a restore); a name a replica lacks, because it was down or restarted, is loaded there
under that same name (`load_missing`: a name always means one path). Which adapter, and
when, is the registry's (proxy/alias/registry.py); one replica's calls are lora_client.py's.
The registry passes what it knows of an adapter in (its name, where its files come from):
the alias sits above the replicas, so nothing here imports it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from overnight.proxy.forward.balancer import Replica

from .lora_client import AdapterError, LoraClient

log = logging.getLogger("overnight.proxy")


async def load_on_all(
    lora: LoraClient, targets: list[Replica], name: str, load: str, path: str
) -> None:
    """Load `load` (the local copy of `path`) as `name` on every one of `targets`, or on
    none: if any refuses, unload it from the others and raise."""
    results = await asyncio.gather(
        *(lora.load_on(r, name, load) for r in targets), return_exceptions=True
    )
    failed = [(r, e) for r, e in zip(targets, results, strict=True) if e is not None]
    if failed:
        loaded = [r for r, e in zip(targets, results, strict=True) if e is None]
        await unload_on_all(lora, loaded, name)
        for _, e in failed:
            if not isinstance(e, AdapterError):
                raise e
        if len(targets) == 1:
            raise failed[0][1]
        raise AdapterError(
            f"{len(failed)} of {len(targets)} replicas did not load {path}; it was unloaded "
            f"from the others and the alias is unchanged: "
            + "; ".join(f"{r.url}: {e}" for r, e in failed),
            status=max(e.status for _, e in failed),
        )


async def load_missing(
    lora: LoraClient,
    replicas: list[Replica],
    name: str,
    local: Callable[[], Awaitable[str]],
) -> None:
    """Load the adapter `name` on each healthy replica that lacks it, from the path
    `local()` gives (asked only when one lacks it: with a bucket, it may fetch)."""
    missing = [r for r in replicas if r.healthy and name not in r.served]
    if not missing:
        return
    try:
        path = await local()
    except AdapterError as e:  # not here, and the bucket cannot give it now
        log.error("cannot load %s on %d replica(s): %s", name, len(missing), e)
        return
    results = await asyncio.gather(
        *(lora.load_on(r, name, path) for r in missing), return_exceptions=True
    )
    for replica, result in zip(missing, results, strict=True):
        if isinstance(result, BaseException):
            log.error("replica %s could not load %s: %s", replica.url, name, result)
        else:
            log.warning("replica %s lacked %s (restarted?): loaded", replica.url, name)


async def unload_on_all(lora: LoraClient, replicas: list[Replica], name: str) -> None:
    """Unload `name` from each of `replicas`; `LoraClient.unload_on` logs what fails."""
    await asyncio.gather(*(lora.unload_on(r, name) for r in replicas))
