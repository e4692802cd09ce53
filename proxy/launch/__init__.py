"""Launching vLLM: a child process with runtime LoRA updating, started and stopped cleanly.

Owns the command line and health wait (`launcher`) and the KV cache sizing on a CPU
(`vllm_cpu`). Imports nothing of the proxy's own: `overnight serve` and the tests use it
without an app.
"""
