"""What each replica answers to a health check: whether it is up, what it serves, and
which base model (and from where) vLLM loaded, for the registry (registry.py)."""

from __future__ import annotations

import asyncio
import logging

from overnight.proxy.forward.balancer import Replica

from .lora_client import LoraClient

log = logging.getLogger("overnight.proxy")


async def check_replicas(lora: LoraClient, replicas: list[Replica]) -> list[list[dict]]:
    """Ask every replica what it serves; mark it healthy or not and note what it serves.
    Returns the model cards of those that answered."""
    failures = [r.failures for r in replicas]
    answers = await asyncio.gather(*(lora.served_models(r) for r in replicas))
    cards = []
    for replica, served, failed_before in zip(replicas, answers, failures, strict=True):
        if served is None:
            if replica.healthy:
                log.warning("replica %s is out: it did not answer", replica.url)
            replica.healthy = False
            continue
        if replica.failures != failed_before:  # a request failed while it answered: the
            continue  # answer is older than the failure; the next check decides
        if not replica.healthy:
            log.info("replica %s answers again", replica.url)
        replica.healthy = True
        replica.served = {m.get("id") for m in served}
        cards.append(served)
    return cards


def base_model_of(
    served: list[dict], base_model: str | None, base_path: str | None
) -> tuple[str | None, str | None]:
    """The base model a replica serves (unless known) and where vLLM loaded it from:
    what a trainer must load too."""
    bases = [m for m in served if not m.get("parent")]
    if base_model is None and bases:
        base_model = bases[0]["id"]
    if base_path is None:
        base_path = next((m.get("root") for m in bases if m["id"] == base_model), None)
    return base_model, base_path
