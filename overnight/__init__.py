"""overnight: an OpenAI-compatible logging proxy in front of vLLM that trains offline."""

__version__ = "0.1.0"
