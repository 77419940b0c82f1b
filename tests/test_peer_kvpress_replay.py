"""The kvpress peer's replay (``benchmarks/peer_kvpress.py``): a press's forward hook called on one press-free
prefill's recorded layer inputs leaves the cache a live prefill under the press leaves. kvpress itself lives in
its own environment (transformers < 5.3), so a stand-in press with kvpress's hook protocol runs here; the script's
``--check-replay`` compares the real presses in kvpress's environment."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from .helpers import tiny_qwen2


class WindowAttentionPress:
    """A SnapKV-like press with kvpress's protocol (``post_init_from_model``, ``forward_hook`` with kwargs,
    ``__call__(model)``): in the prefill, each layer keeps the ``kept`` tokens its last ``window`` queries
    (from the hook's hidden states, rotated by its position embeddings) attend to most, in order."""

    def __init__(self, kept: int, window: int = 4):
        self.kept, self.window, self.models_seen = kept, window, 0

    def post_init_from_model(self, model) -> None:
        self.models_seen += 1

    def forward_hook(self, module, input, kwargs: dict, output):
        # kvpress's transformers (< 5.3) names the cache ``past_key_values``; kvpack's names it ``cache``
        hidden, cache = kwargs["hidden_states"], kwargs.get("past_key_values", kwargs.get("cache"))
        if hidden.shape[1] == 1:  # a decode step, not the prefill
            return output
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values  # [1, kv heads, tokens, d]
        d = module.head_dim
        q = module.q_proj(hidden[:, -self.window:]).view(1, self.window, -1, d).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -self.window:], sin[:, -self.window:])
        groups = q.shape[1] // keys.shape[1]
        scores = (q @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2)).softmax(-1).sum(dim=(0, 1, 2))
        keep = scores.topk(self.kept).indices.sort().values
        layer.keys, layer.values = keys[:, :, keep], values[:, :, keep]
        return output

    @contextlib.contextmanager
    def __call__(self, model):
        self.post_init_from_model(model)
        hooks = []
        for layer in model.model.layers:
            layer.self_attn.rotary_emb = model.model.rotary_emb
            hooks.append(layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()


def _peer_kvpress(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import peer_kvpress

    return peer_kvpress


@torch.no_grad()
def test_replayed_press_leaves_the_live_prefills_cache_and_the_exact_cache_untouched(monkeypatch):
    peer_kvpress = _peer_kvpress(monkeypatch)
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()

    exact, seconds, records = peer_kvpress.recorded_prefill(model, ids)
    assert seconds > 0 and sorted(records) == [0, 1]
    for kept in (7, 25):
        live = DynamicCache()
        with WindowAttentionPress(kept)(model):
            model(input_ids=torch.tensor([ids]), past_key_values=live, use_cache=True)
        press = WindowAttentionPress(kept)
        again, press_s = peer_kvpress.replayed(model, press, exact, records)
        assert press.models_seen == 1 and press_s >= 0
        for a, b in zip(live.layers, again.layers, strict=True):
            assert a.keys.shape[2] == kept
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    reference = DynamicCache()
    model(input_ids=torch.tensor([ids]), past_key_values=reference, use_cache=True)
    for e, r in zip(exact.layers, reference.layers, strict=True):  # the replays worked on copies
        assert e.keys.shape[2] == len(ids) and torch.equal(e.keys, r.keys) and torch.equal(e.values, r.values)


@torch.no_grad()
def test_a_replay_on_another_prompts_records_differs(monkeypatch):
    """The comparison can fail: the records of another prompt give another cache."""
    peer_kvpress = _peer_kvpress(monkeypatch)
    model = tiny_qwen2()
    gen = torch.Generator().manual_seed(4)
    ids, other = (torch.randint(0, 128, (40,), generator=gen).tolist() for _ in range(2))
    live = DynamicCache()
    with WindowAttentionPress(10)(model):
        model(input_ids=torch.tensor([ids]), past_key_values=live, use_cache=True)
    exact, _, records = peer_kvpress.recorded_prefill(model, ids)
    _, _, other_records = peer_kvpress.recorded_prefill(model, other)
    wrong, _ = peer_kvpress.replayed(model, WindowAttentionPress(10), exact, other_records)
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(live.layers, wrong.layers, strict=True))
