"""Trainer: GRPO on LoRA from logged records.

records -> token sequences and masks (`data`, `records`), which groups a run takes and
why not others (`plan`), the GRPO loss with its normalisation variants (`loss`, math in
docs/grpo.md), packed policy logprobs (`policy`), one optimizer step over micro-batches
(`step`), one or many processes (`parallel`), what a run keeps on disk to resume
(`checkpoint`), the proxy's admin API (`proxy_client`), and the nightly run that ties
them together (`train`).
"""
