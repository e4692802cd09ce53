"""The adapters on the vLLM replicas: vLLM's runtime LoRA endpoints (`lora_client`), an
adapter loaded on every replica or none (`loading`), the replicas' health check
(`health`), and the requests in flight per adapter that a swap drains (`in_flight`).
May import `forward` and `overnight.storage`; never the alias above it.
"""
