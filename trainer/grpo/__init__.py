"""The numerics: logged records to token sequences, the GRPO loss, one optimizer step.

Owns records to samples (`records`, `data`; for --sft nights, conversations rendered with
the local chat template: `render`), vLLM's sampling distribution redone
(`sampling`), the policy and its packed logprobs (`policy`), the loss and its
normalisation variants (`loss`, math in docs/grpo.md), one step over micro-batches
(`step`) and one process or many (`parallel`). Imports torch (where tensors are made)
and `overnight.config`; never the night's decisions, the storage or the proxy: what it
trains on arrives as Arrow rows or samples.
"""
