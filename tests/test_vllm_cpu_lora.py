"""vLLM's LoRA on a CPU through our plugin (proxy/launch/vllm_cpu_lora.py): the same sums
as vLLM's own ops for every adapter row, nothing for a row of no adapter, and on the real
vLLM a base-model request batched beside two adapters' answers as it does alone."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

from overnight.proxy.launch import vllm_cpu_lora

from .vllm_fixtures import _require_vllm, random_lora


@pytest.fixture(scope="module")
def vllm_ops():
    _require_vllm()
    from vllm.lora.ops import torch_ops

    return torch_ops


def batch(tokens: int, width: int, out: int, slots: int, seed: int, four_d: bool):
    """Inputs, stacked adapter weights and each row's adapter (-1 for none, mixed in)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    w = torch.randn(slots, out, width, generator=g)
    indices = torch.randint(-1, slots, (tokens,), generator=g)
    return x, (w.unsqueeze(1) if four_d else w), indices


@pytest.mark.parametrize("four_d", [True, False])
def test_each_op_sums_as_vllm_s_for_adapter_rows_and_adds_nothing_for_others(vllm_ops, four_d):
    x, w, indices = batch(37, 24, 8, 3, seed=1, four_d=four_d)
    has = (indices >= 0).unsqueeze(1)
    assert has.any() and not has.all()  # both kinds of row, several adapters
    # shrink: written, scaled
    ours, theirs = torch.full((37, 10), 7.0), torch.full((37, 10), 7.0)
    vllm_cpu_lora.bgmv_shrink(x, w, ours, indices, 0.5)
    vllm_ops.bgmv_shrink(x, w, theirs, indices, 0.5)
    assert torch.allclose(ours[:, :8], torch.where(has, theirs[:, :8], 0.0), atol=1e-5)
    assert (ours[:, 8:] == 7.0).all()  # the columns past the adapter's are left alone
    # expand, added or written; and a slice of a wider output
    for add in (True, False):
        y = torch.randn(37, 8)
        base = torch.randn(37, 30)
        ours, theirs = base.clone(), base.clone()
        vllm_cpu_lora.bgmv_expand(y, w.transpose(-1, -2), ours, indices, add)
        vllm_ops.bgmv_expand(y, w.transpose(-1, -2), theirs, indices, add)
        kept = base[:, :24] if add else torch.zeros(37, 24)
        assert torch.allclose(ours[:, :24], torch.where(has, theirs[:, :24], kept), atol=1e-5)
        assert torch.equal(ours[:, 24:], base[:, 24:])
        ours, theirs = base.clone(), base.clone()
        vllm_cpu_lora.bgmv_expand_slice(y, w.transpose(-1, -2), ours, indices, 4, 24, add)
        vllm_ops.bgmv_expand_slice(y, w.transpose(-1, -2), theirs, indices, 4, 24, add)
        kept = base[:, 4:28] if add else torch.zeros(37, 24)
        assert torch.allclose(ours[:, 4:28], torch.where(has, theirs[:, 4:28], kept), atol=1e-5)
        assert torch.equal(ours[:, :4], base[:, :4]) and torch.equal(ours[:, 28:], base[:, 28:])


def test_a_prefill_s_segments_take_their_sequence_s_adapter(vllm_ops):
    x, w, _ = batch(9, 16, 4, 2, seed=2, four_d=True)
    starts, lengths, adapters = (
        torch.tensor([0, 4, 6]),
        torch.tensor([4, 2, 3]),
        torch.tensor([1, 0, 1]),
    )
    ours, theirs = torch.zeros(9, 4), torch.zeros(9, 4)
    segments = (starts, lengths, adapters, 3, 4, 9)
    vllm_cpu_lora.sgmv_shrink(x, w, ours, *segments, 2.0)
    vllm_ops.sgmv_shrink(x, w, theirs, *segments, 2.0)
    assert torch.allclose(ours, theirs, atol=1e-5)
    expanded_ours, expanded_theirs = torch.ones(9, 16), torch.ones(9, 16)
    vllm_cpu_lora.sgmv_expand(ours, w.transpose(-1, -2), expanded_ours, *segments, True)
    vllm_ops.sgmv_expand(theirs, w.transpose(-1, -2), expanded_theirs, *segments, True)
    assert torch.allclose(expanded_ours, expanded_theirs, atol=1e-4)
    one_adapter = torch.full((9,), 1)  # the usual batch: every row the same adapter
    y = torch.zeros(9, 4)
    vllm_cpu_lora.bgmv_shrink(x, w, y, one_adapter, 1.0)
    assert torch.allclose(y, x @ w[1, 0].T, atol=1e-5)
    empty = torch.zeros(0, 4)
    vllm_cpu_lora.bgmv_shrink(x[:0], w, empty, one_adapter[:0], 1.0)  # nothing scheduled


def test_it_patches_only_when_asked_and_only_the_ops_it_knows(vllm_ops, monkeypatch):
    from vllm.lora.punica_wrapper import punica_cpu

    assert vllm_cpu_lora.mismatches(vllm_ops) == []  # the installed vLLM's are 0.32's
    originals = {name: getattr(punica_cpu, name) for name in vllm_cpu_lora.OPS}
    for name, op in originals.items():
        monkeypatch.setattr(punica_cpu, name, op)  # put back after the test
    monkeypatch.delenv(vllm_cpu_lora.ENV, raising=False)
    vllm_cpu_lora.register()  # a vLLM someone else started: left alone
    assert all(getattr(punica_cpu, n) is op for n, op in originals.items())
    monkeypatch.setenv(vllm_cpu_lora.ENV, "1")
    vllm_cpu_lora.register()
    assert all(getattr(punica_cpu, n) is vllm_cpu_lora.OPS[n] for n in originals)

    class Renamed:  # another vLLM whose op takes other parameters
        def bgmv_shrink(inputs, weights, out, indices):  # noqa: N805
            pass

    assert "bgmv_shrink" in vllm_cpu_lora.mismatches(Renamed)


def test_our_launcher_asks_for_it_in_the_vllm_it_starts_on_a_cpu(vllm_server):
    assert vllm_cpu_lora.ENV not in os.environ  # set for the child only
    with open(f"/proc/{vllm_server.process.pid}/environ", "rb") as f:
        child = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    assert child[vllm_cpu_lora.ENV.encode()] == b"1"


def test_a_base_request_batched_beside_two_adapters_answers_as_it_does_alone(
    vllm_server, lora_adapter, tiny_model_dir, tmp_path
):
    """Without the plugin vLLM 0.32 on a CPU gave the base-model requests of this batch
    the second adapter's answer token for token (the last slot's weights)."""
    names = {"mixed-a": lora_adapter, "mixed-b": random_lora(tiny_model_dir, 2, tmp_path / "b")}
    for name, path in names.items():
        r = httpx.post(vllm_server.url + "/v1/load_lora_adapter",
                       json={"lora_name": name, "lora_path": str(path)}, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text

    async def greedy(client: httpx.AsyncClient, model: str) -> tuple[str, list[float]]:
        r = await client.post(vllm_server.url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": "The number of the day is", "max_tokens": 16,
            "temperature": 0, "logprobs": 0})  # fmt: skip
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]

    async def run():
        async with httpx.AsyncClient() as client:
            alone = await greedy(client, "tiny")
            mixed = await asyncio.gather(*(greedy(client, m) for m in
                                           ("mixed-a", "mixed-b", "tiny", "mixed-a", "tiny")))  # fmt: skip
            return alone, mixed

    try:
        alone, (a, b, base, a_again, base_again) = asyncio.run(run())
    finally:
        for name in names:
            httpx.post(vllm_server.url + "/v1/unload_lora_adapter", json={"lora_name": name},
                       timeout=60)  # fmt: skip
    assert len({alone[0], a[0], b[0]}) == 3  # three models, three answers
    assert a_again[0] == a[0]
    for answer in (base, base_again):
        assert answer[0] == alone[0]
        assert max(abs(x - y) for x, y in zip(answer[1], alone[1], strict=True)) < 1e-4
