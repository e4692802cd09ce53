"""The proxy's calls to vLLM's runtime LoRA endpoints and model list, on each replica.

vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` are reached only by the
proxy (forward/paths.py keeps agents away from them); registry.py decides when to call them.
"""

from __future__ import annotations

import logging

import aiohttp

from overnight.errors import OvernightError
from overnight.proxy.forward.balancer import Replica

log = logging.getLogger("overnight.proxy")


class AdapterError(OvernightError):
    status = 400
    code = "adapter_error"


class LoraClient:
    """Loading, unloading and listing on one replica at a time, through one session."""

    def __init__(self, headers: dict[str, str]):
        self.headers = headers
        self.session: aiohttp.ClientSession | None = None  # set once the app runs

    async def load_on(self, replica: Replica, name: str, path: str) -> None:
        status, text = await self._post(
            replica, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
        )
        # Loaded already: by another proxy in front of the same replica, or by a first try
        # whose answer was lost. Names are never reused, so it is this adapter.
        if status != 200 and "already" not in text:
            raise AdapterError(
                f"vLLM refused to load {path} as {name} (HTTP {status}): {text[:500]}",
                status=502 if status >= 500 else 400,
            )
        replica.served.add(name)

    async def unload_on(self, replica: Replica, name: str) -> None:
        """Unload, logging what fails (a 404: gone already, e.g. unloaded by another proxy)."""
        try:
            status, text = await self._post(replica, "/v1/unload_lora_adapter", {"lora_name": name})
        except AdapterError as e:
            log.warning("could not unload %s from %s: %s", name, replica.url, e)
            return
        replica.served.discard(name)
        if status == 200:
            log.info("unloaded %s from %s", name, replica.url)
        elif status != 404:
            log.warning("vLLM did not unload %s (HTTP %d): %s", name, status, text[:300])

    async def _post(self, replica: Replica, path: str, payload: dict) -> tuple[int, str]:
        assert self.session is not None, "registry used before the app started"
        for attempt in (1, 2):
            try:
                async with self.session.post(
                    replica.url + path, json=payload, headers=self.headers
                ) as r:
                    return r.status, await r.text()
            except aiohttp.ServerDisconnectedError as e:
                # A pooled connection the server closed: once more on a new one
                # (docs/architecture.md; a load that did arrive answers "already loaded").
                if attempt == 2:
                    raise AdapterError(f"vLLM unreachable at {replica.url}: {e}", 502) from e
            except (aiohttp.ClientError, TimeoutError) as e:
                raise AdapterError(f"vLLM unreachable at {replica.url}: {e}", status=502) from e
        raise AssertionError("unreachable")

    async def served_models(self, replica: Replica) -> list[dict] | None:
        """vLLM's /v1/models entries; None when it cannot be asked (down, restarting)."""
        assert self.session is not None
        try:
            async with self.session.get(
                replica.url + "/v1/models",
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:
                if r.status == 200:
                    return (await r.json()).get("data", [])
                log.warning("listing the models of %s answered HTTP %d", replica.url, r.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("could not list the models of %s: %s", replica.url, e)
        return None
