"""The fake vLLM's model list, its runtime LoRA endpoints, its health check, and sleep.

Loading an adapter only names it: /v1/models lists it, and unloading forgets it. Sleep
follows vLLM's dev-mode routes (`VLLM_SERVER_DEV_MODE=1`): `POST /sleep?level=N`,
`POST /wake_up[?tags=...]`, `GET /is_sleeping`; while asleep every generating request
is refused (503), so a test sees any that reached it (a real vLLM asleep on a GPU has no
weights to answer with; on a CPU it never answers).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .fake_shared import SETTINGS, record


async def models(request: web.Request) -> web.Response:
    data = [
        {
            "id": "fake-base",
            "object": "model",
            "owned_by": "vllm",
            "root": "fake-base",
            "parent": None,
            # vLLM gives it on the base model's card only; None: a card without it
            "max_model_len": request.app[SETTINGS]["max_model_len"],
        }
    ]
    for name, path in request.app[SETTINGS]["loras"].items():
        data.append(
            {"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": "fake-base"}
        )
    # Tests set it to answer with a list made before a change that lands meanwhile
    # (unset: no sleep at all, not even a yield to the loop).
    delay = request.app[SETTINGS].get("models_delay")
    if delay:
        await asyncio.sleep(delay)
    return web.json_response({"object": "list", "data": data})


async def load_lora(request: web.Request) -> web.Response:
    body = await request.json()
    record(request, body)
    loras = request.app[SETTINGS]["loras"]
    if body["lora_name"] in loras:
        return web.json_response({"error": {"message": "already loaded", "code": 400}}, status=400)
    loras[body["lora_name"]] = body["lora_path"]
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def unload_lora(request: web.Request) -> web.Response:
    body = await request.json()
    record(request, body)
    if request.app[SETTINGS]["loras"].pop(body["lora_name"], None) is None:
        return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
    return web.Response(text="Success")


async def health(request: web.Request) -> web.Response:
    return web.Response()


GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@web.middleware
async def refuse_while_asleep(request: web.Request, handler):
    if request.app[SETTINGS]["asleep"] and request.path in GENERATING:
        record(request, None)
        return web.json_response({"error": {"message": "asleep", "code": 503}}, status=503)
    return await handler(request)


async def sleep(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    settings["asleep"] = True
    settings["sleeps"].append(f"sleep?level={request.query.get('level', '1')}")
    return web.json_response({"status": "sleeping"})


async def wake_up(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    tags = request.query.get("tags")
    settings["sleeps"].append(f"wake_up?tags={tags}" if tags else "wake_up")
    if tags in (None, "kv_cache"):  # weights first, then the cache: awake once both are
        settings["asleep"] = False
    return web.json_response({"status": "awake"})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[SETTINGS]["asleep"]})
