"""The fake vLLM's model list, its runtime LoRA endpoints, and its health check.

Loading an adapter only names it: /v1/models lists it, and unloading forgets it.
"""

from __future__ import annotations

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
