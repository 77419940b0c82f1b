"""``pca_quant``: water-filled widths, bytes against the tensors held, reconstruction quality against a
threshold, pre-RoPE bases, refusals. (The registry-wide invariants are in test_method_matrix.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpack.attention.softmax_merge import finalize, merge_partials
from kvpack.ops.accounting import dense_bf16_bytes
from kvpack.ops.minmax import quantize_minmax
from kvpack.ops.rope import rope_at
from kvpack.resident.pca_quant import (
    MEASURED_BLOCKS,
    PCAQuantConfig,
    PCAQuantStore,
    measured_blocks,
    measured_distortion,
    minmax_distortion,
    water_fill_order,
)

from .helpers import anchor_layout, correlated_kv


def _store(H=2, d=64, T=2000, rope=True, seed=0, **cfg):
    layout = anchor_layout(H=H, d=d, rope=rope)
    store = PCAQuantStore(layout, PCAQuantConfig(**cfg))
    k, v = correlated_kv(H, T, d, seed=seed)
    if rope:
        k = rope_at(layout.rope, k, 0)  # the model hands over post-RoPE keys
    store.append(k, v)
    return store, k, v


def _snr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(20 * torch.log10(x.norm() / (x - x_hat).norm()))


def test_water_filling_buys_bits_where_the_variance_is():
    # one head: keys with variances 16, 4, 1, 0; values flat
    var = torch.tensor([[[16.0, 4.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])
    order = water_fill_order(var, max_bits=8, block=128, first_cost=0.25).tolist()
    keys = [(j, w) for h, side, j, w in order if side == 0]
    assert keys[0] == (0, 2) and all(j != 3 for j, _ in keys)  # the largest first, at 2 bits; zero never
    assert {w for _, w in keys} == set(range(2, 9))  # 2 bits first, then one at a time up to max_bits
    # More variance, never fewer bits, at every point of the order.
    widths = [0, 0, 0]
    for j, w in keys:
        widths[j] = w
        assert widths[0] >= widths[1] >= widths[2], widths
    assert len(order) == 3 * 7 + 4 * 7  # every coded component: one purchase of 2 bits, then 6 of 1


def test_a_costly_first_purchase_still_comes_before_the_next_and_gains_fall():
    # first_cost so large that a component's first purchase gains less per bit than its second: the
    # second follows the first at once (a heap would offer it only then), never before it
    var = torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(0)) ** 4
    order = water_fill_order(var, max_bits=6, block=64, first_cost=6.0).tolist()
    seen: dict[tuple, int] = {}
    for h, side, j, w in order:
        assert w == (2 if (h, side, j) not in seen else seen[(h, side, j)] + 1)
        seen[(h, side, j)] = w
    assert len(order) == 3 * 2 * 16 * 5
    share = var / var.sum(-1, keepdim=True)
    firsts = [share[h, s, j].item() for h, s, j, w in order if w == 2]
    assert firsts == sorted(firsts, reverse=True)  # first purchases in decreasing share


def test_staggered_layers_code_their_blocks_at_different_decode_steps():
    from dataclasses import replace

    base = anchor_layout(H=1, d=32, rope=False)
    k, v = correlated_kv(1, 600, 32, seed=3)
    coded_at: dict[int, list[int]] = {}
    for stagger in (True, False):
        stores = [PCAQuantStore(replace(base, layer_idx=i), PCAQuantConfig(budget=0.4, block=16, stagger=stagger))
                  for i in range(12)]
        for st in stores:
            st.append(k[:, :500], v[:, :500])
        per_step = []
        for t in range(500, 600):  # decode: how many layers code a block at each step
            before = [st.n_blocks for st in stores]
            for st in stores:
                st.append(k[:, t:t + 1], v[:, t:t + 1])
            per_step.append(sum(st.n_blocks != b for st, b in zip(stores, before)))
        coded_at[stagger] = per_step
        for st in stores:
            assert st.nbytes() <= 0.4 * dense_bf16_bytes(st.seq_len, 1, 32)
    assert max(coded_at[False]) == 12  # every layer at the same step
    assert max(coded_at[True]) <= 2 and sum(coded_at[True]) >= 12 * (100 // 16)  # as many blocks, spread


def test_per_side_balance_gives_a_head_with_more_energy_more_bits_per_head_balance_does_not():
    # two heads with the same spectrum, the second at 5x the energy (as a layer's key heads can differ)
    var = torch.rand(1, 2, 16, generator=torch.Generator().manual_seed(1)) + 0.1
    var = torch.cat([var, 5 * var])  # [H = 2, 2, 16]

    def widths(order, n):
        w = torch.zeros(2, 2, 16, dtype=torch.long)
        for h, side, j, bits in order[:n].tolist():
            w[h, side, j] = bits
        return w

    per_head = water_fill_order(var, max_bits=8, block=64, first_cost=0.5)
    per_side = water_fill_order(var, max_bits=8, block=64, first_cost=0.5, per_side=True)
    n = len(per_head) // 3 // 2 * 2  # a third of the purchases (even: per head, the heads tie pairwise)
    wh, ws = widths(per_head, n), widths(per_side, n)
    assert torch.equal(wh[0], wh[1])  # each head on its own share: the scale is invisible
    assert ws[1].sum() > ws[0].sum() + 16  # one side's total: 5x the energy buys more than a bit a component more
    assert (ws[1] >= ws[0]).all()


def test_the_query_metric_prices_a_key_direction_by_the_logit_change_it_makes():
    layout = anchor_layout(H=2, group=3, d=16, rope=True)
    store = PCAQuantStore(layout, PCAQuantConfig())
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, 40, 16, generator=g)  # post-RoPE queries at positions 100..139
    store._add_query_moment(q, 100, rows=1000, keys=8)  # every query row, 8 key positions each
    moment = store.query_moment / store.query_rows
    u = torch.randn(16, generator=g)
    for h in range(2):
        rows = q[3 * h:3 * h + 3].reshape(-1, 16)  # the group's rows, query head-major
        changes = []
        for r, row in enumerate(rows):
            p = 100 + r % 40
            for k in range(8):  # a unit error along u in a key at position t moves the logit by q · RoPE_t(u)
                t = int(p * (k + 0.5) / 8)
                changes.append(row @ rope_at(layout.rope, u[None], t)[0])
        brute = torch.stack(changes).square().mean()
        assert torch.allclose(u @ moment[h] @ u, brute, rtol=1e-3), (h, float(u @ moment[h] @ u), float(brute))


def test_the_query_metric_codes_a_quiet_key_direction_the_queries_read():
    # keys: eight loud channels the queries ignore, eight quiet ones; the queries read only the last channel
    H, d, T = 1, 16, 1024
    g = torch.Generator().manual_seed(3)
    k = torch.randn(H, T, d, generator=g) * torch.tensor([4.0] * 8 + [0.05] * 8)
    v = torch.randn(H, T, d, generator=g)
    q = torch.zeros(H, T, d)
    q[..., -1] = 30.0 * torch.randn(H, T, generator=g)

    def coded_along_last_channel(metric):
        store = PCAQuantStore(anchor_layout(H=H, group=1, d=d, rope=False),
                              PCAQuantConfig(budget=0.2, key_metric=metric, balance="side"))
        store.append(k, v, q)
        coded_keys = int((store.widths[0, 0] > 0).sum())
        # the share of the last channel the coded key components span (the quiet channels' basis is any
        # rotation within them: the channel may spread over several components)
        return float(store.basis[:coded_keys, -1].float().square().sum()), coded_keys

    along, coded = coded_along_last_channel("variance")
    assert along < 0.2 and coded < 16  # priced by variance: the quiet channels are dropped
    along, _ = coded_along_last_channel("queries")
    assert along > 0.9  # priced by the logit error: coded


def test_a_head_the_budget_buys_nothing_for_is_its_mean_and_attention_still_matches():
    layout = anchor_layout(H=2, d=64, rope=True)
    k, v = correlated_kv(2, 2000, 64, seed=0)
    k[1] *= 1e-3  # a quiet key head: at a low budget, with the heads of a side on one scale, no bit goes to it
    k = rope_at(layout.rope, k, 0)
    store = PCAQuantStore(layout, PCAQuantConfig(budget=0.08, balance="side", key_metric="variance"))
    store.append(k, v)
    assert int(store.widths[0, 1].sum()) == 0 and int(store.widths[0, 0].sum()) > 0
    assert store.nbytes() <= 0.08 * dense_bf16_bytes(store.seq_len, 2, 64)
    k_hat, v_hat = store.reconstruct()
    n = store.n_blocks * 64
    qg = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    s = torch.einsum("hqd,htd->hqt", qg, k_hat[:, 4:4 + n]) * 0.125
    expected = torch.einsum("hqt,htd->hqd", s.softmax(-1), v_hat[:, 4:4 + n])
    for backend in ("torch", "native"):
        store.config = dataclasses.replace(store.config, attention_backend=backend)
        got = finalize(merge_partials(store.history_partials(qg, 0.125)))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_measured_distortion_charges_heavy_tails_and_keeps_the_budget():
    g = torch.Generator().manual_seed(5)
    gauss = torch.randn(1024, generator=g)
    spiky = 0.1 * torch.randn(1024, generator=g)  # small noise and one spike of 8 a block: variance near 1,
    spiky[::64] = 8.0  # but a range of 8 that the min/max code spends its levels on
    c = torch.stack([gauss, spiky], dim=-1).expand(2, 1, 1024, 2).contiguous()
    store = PCAQuantStore(anchor_layout(H=1, d=2, rope=False), PCAQuantConfig(block=64, distortion="measured"))
    cfg = store.config
    table = measured_distortion(measured_blocks(c, cfg.block), cfg.block, cfg.max_bits)  # [H, 2, d, widths]
    assert table.shape == (1, 2, 2, 9) and torch.all(table[..., 0] == 1)
    assert abs(float(table[0, 0, 0, 4]) - minmax_distortion(4, 64)) < 0.01  # Gaussian: as the model says
    assert float(table[0, 0, 1, 4]) > 1.5 * float(table[0, 0, 0, 4])  # the spiky one keeps more error a bit
    for budget in (0.28, 0.15):
        st, _, _ = _store(budget=budget, distortion="measured")
        assert st.nbytes() <= budget * dense_bf16_bytes(st.seq_len, 2, 64)


@pytest.mark.parametrize("n_blocks", [3, MEASURED_BLOCKS + 9])
def test_measured_distortion_is_the_error_of_the_min_max_codes(n_blocks):
    """The measured table against its definition: quantize_minmax's codes, dequantized, per block (over
    at most MEASURED_BLOCKS of them, evenly spaced)."""
    g = torch.Generator().manual_seed(6)
    c = torch.randn(2, 2, 64 * n_blocks + 8, 8, generator=g) * torch.linspace(2.0, 0.05, 8)  # whole blocks + a rest
    c[0, 1, 17, 3] = 9.0  # an outlier
    store = PCAQuantStore(anchor_layout(H=2, d=8, rope=False), PCAQuantConfig(block=64, distortion="measured"))
    cfg = store.config
    table = measured_distortion(measured_blocks(c, cfg.block), cfg.block, cfg.max_bits)  # [H, 2, d, widths]
    blocks = c[:, :, :64 * n_blocks].reshape(2, 2, n_blocks, 64, 8)
    if n_blocks > MEASURED_BLOCKS:
        blocks = blocks[:, :, torch.linspace(0, n_blocks - 1, MEASURED_BLOCKS).round().long()]
    var = blocks.var(dim=(2, 3), correction=0)
    for w in range(2, 9):
        codes, scale, zero = quantize_minmax(blocks, dim=3, bits=w)
        err = ((codes.float() * scale.float() + zero.float() - blocks) ** 2).mean(dim=(2, 3))
        expected = (err / var).clamp(max=1.0).permute(1, 0, 2)  # [H, 2, d]
        torch.testing.assert_close(table[..., w], expected, rtol=1e-4, atol=1e-7)
    assert torch.all(table[..., 1] == 1)  # never bought: left at "no better than dropping it"


def test_one_bit_min_max_is_no_better_than_dropping_the_component():
    assert minmax_distortion(0, 128) == 1.0 and minmax_distortion(1, 128) == 1.0
    assert minmax_distortion(2, 128) < 0.4 and minmax_distortion(8, 128) < 1e-4


@pytest.mark.parametrize("budget", [0.5, 0.28, 0.15])
def test_bytes_are_the_tensors_held_and_within_the_budget(budget):
    store, _, _ = _store(budget=budget)
    H, d = 2, 64
    assert store.n_blocks > 0
    assert store.nbytes() == sum(t.numel() * t.element_size() for t in store.tensors().values())
    assert store.nbytes() == store._bytes(store.seq_len, store.widths)  # the formula the widths were solved with
    assert store.nbytes() <= budget * dense_bf16_bytes(store.seq_len, H, d)
    for t in range(200):  # decoding: blocks coded as the tail fills, never above the budget
        k, v = correlated_kv(H, 1, d, seed=100 + t)
        store.append(rope_at(store.layout.rope, k, store.seq_len), v)
        assert store.nbytes() <= budget * dense_bf16_bytes(store.seq_len, H, d), t


def test_reconstruction_error_falls_as_the_budget_grows():
    snr = {}
    for budget in (0.15, 0.28, 0.5):
        store, k, v = _store(budget=budget)
        k_hat, v_hat = store.reconstruct()
        snr[budget] = (_snr_db(k, k_hat), _snr_db(v, v_hat))
    assert snr[0.5][0] > 30 and snr[0.5][1] > 30  # 0.5 of bf16 is 8 bits a value: near lossless
    assert snr[0.28][0] > 20 and snr[0.28][1] > 20
    assert snr[0.15][0] > 10 and snr[0.15][1] > 10
    assert snr[0.15] < snr[0.28] < snr[0.5]


def test_the_sink_and_the_tail_are_exact_and_the_history_is_decoded_in_order():
    store, k, v = _store(budget=0.28, sinks=4, residual=32, block=128)
    k_hat, v_hat = store.reconstruct()
    tail = store.tail_k.shape[1]
    bf16 = lambda x: x.to(torch.bfloat16).float()  # noqa: E731 - the dense regions' storage dtype
    assert torch.equal(k_hat[:, :4], bf16(k[:, :4])) and torch.equal(v_hat[:, -tail:], bf16(v[:, -tail:]))
    lag = store.kept_recent - 32  # this layer's stagger
    assert 0 < lag < 128 and 32 + lag <= tail < 32 + lag + 128 and store.n_blocks * 128 + 4 + tail == 2000


def test_a_pre_rope_basis_keeps_rotated_keys_better_than_a_post_rope_one():
    pre, k, _ = _store(budget=0.15, key_rope="pre")
    post, _, _ = _store(budget=0.15, key_rope="post")
    assert _snr_db(k, pre.reconstruct()[0]) > _snr_db(k, post.reconstruct()[0]) + 3


def test_a_block_relative_basis_keeps_the_rotated_keys_as_a_pre_rope_one_does():
    """Keys rotated back by their block's first position only (RoPE within a block kept): the same keys come
    back rotated to their own positions, about as well as from a pre-RoPE basis (within 3 dB; here 20.3 vs
    19.3 dB) and far better than from a post-RoPE one (11.8 dB); a wrong position anywhere would be noise."""
    block, k, _ = _store(budget=0.15, key_rope="block")
    pre, _, _ = _store(budget=0.15, key_rope="pre")
    post, _, _ = _store(budget=0.15, key_rope="post")
    snr = _snr_db(k, block.reconstruct()[0])
    assert snr > _snr_db(k, pre.reconstruct()[0]) - 3 and snr > _snr_db(k, post.reconstruct()[0]) + 3
    assert block.blocks_view().rope_at_block and not pre.blocks_view().rope_at_block


def test_attention_over_the_blocks_equals_attention_over_the_reconstruction():
    from kvpack.attention.softmax_merge import dense_partial, merge_partials

    store, _, _ = _store(budget=0.28, attention_backend="torch")  # the PyTorch path, in fp64 here
    qg = torch.randn(2, 3, 64, dtype=torch.float64)
    got = merge_partials(store.stored_partials(qg, 0.125))
    k_hat, v_hat = store.reconstruct()
    want = dense_partial(qg, k_hat.double(), v_hat.double(), 0.125)
    torch.testing.assert_close(got.o / got.l[..., None], want.o / want.l[..., None], rtol=1e-5, atol=1e-6)


native = pytest.importorskip("kvpack.attention.cpu").native


@pytest.mark.parametrize("d,H,M,block,T,rope,key_rope", [
    (64, 2, 3, 128, 2100, True, "pre"), (80, 3, 7, 24, 700, True, "pre"), (48, 1, 1, 16, 300, False, "auto"),
    (64, 2, 3, 128, 2100, True, "post"), (80, 3, 7, 24, 700, True, "post"), (64, 2, 3, 128, 2100, True, "block"),
    (80, 3, 7, 24, 700, True, "block")])
def test_native_kernel_matches_an_fp64_reference(d, H, M, block, T, rope, key_rope):
    """The CPU kernel against the PyTorch path in fp64 on odd shapes: a head of 80 (a partial vector), 7
    query rows a head, blocks of 24 and 16, a split count that leaves a short last split, no RoPE; keys
    rebuilt and rotated (a pre-RoPE basis) and scored in the basis (a post-RoPE one, no RoPE, a block-relative
    one: the query rotated back once a block)."""
    from kvpack.attention.pca_blocks import pca_blocks_partial, pca_blocks_partials
    from kvpack.attention.softmax_merge import merge_partials

    if native() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    store, _, _ = _store(H=H, d=d, T=T, rope=rope, budget=0.3, block=block, residual=8, key_rope=key_rope)
    blocks = store.blocks_view()
    assert blocks.n_blocks > 12 and (blocks.rope is not None) == (key_rope in ("pre", "block"))
    assert len({w for runs in store.groups for w, _ in runs}) >= 3  # several widths, so several streams a block
    qg = torch.randn(H, M, d, generator=torch.Generator().manual_seed(1))
    got = pca_blocks_partial(blocks, qg, d ** -0.5)
    want = merge_partials(pca_blocks_partials(blocks, qg.double(), d ** -0.5))
    torch.testing.assert_close(got.o / got.l[..., None], (want.o / want.l[..., None]).float(), rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got.m, want.m.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,H,M,block,T,rope,key_rope", [
    (64, 2, 3, 64, 1200, True, "pre"), (80, 3, 7, 24, 500, True, "pre"), (48, 1, 1, 16, 300, False, "auto"),
    (80, 3, 7, 24, 500, True, "block")])
def test_triton_kernel_matches_an_fp64_reference(d, H, M, block, T, rope, key_rope):
    """The Triton kernel (under the interpreter on CPU) against the PyTorch path in fp64, the same odd
    shapes as the native kernel's test."""
    import os

    from kvpack.attention.pca_blocks import pca_blocks_partials
    from kvpack.attention.softmax_merge import merge_partials

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not set")
    store, _, _ = _store(H=H, d=d, T=T, rope=rope, budget=0.3, block=block, residual=8, attention_backend="triton",
                         key_rope=key_rope)
    assert store.n_blocks > 4 and len({w for runs in store.groups for w, _ in runs}) >= 3
    qg = torch.randn(H, M, d, generator=torch.Generator().manual_seed(1))
    (got,) = store.history_partials(qg, d ** -0.5)
    want = merge_partials(pca_blocks_partials(store.blocks_view(), qg.double(), d ** -0.5))
    torch.testing.assert_close(got.o / got.l[..., None], (want.o / want.l[..., None]).float(), rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got.m, want.m.float(), rtol=1e-5, atol=1e-5)


def test_native_kernel_refuses_a_layout_that_does_not_match_the_widths():
    from kvpack.attention.pca_blocks import ROPE_TOKEN, pca_quant_attention

    if native() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    store, _, _ = _store(budget=0.28)
    b = store.blocks_view()
    q = torch.randn(2, 3, 64)
    cos, sin = store.layout.rope.table(store.seq_len, q.device)
    none = torch.empty(0, 0, dtype=torch.int32)
    args = (b.scale, b.zero, b.basis, b.mean, b.widths, cos, sin, none, b.block, ROPE_TOKEN, b.first_position, 0.125,
            16)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        pca_quant_attention(q, b.codes[:, 1:].contiguous(), *args)
    bad = b.widths.clone()
    bad[0, 0, -1] = 8
    with pytest.raises(RuntimeError, match="non-increasing"):
        pca_quant_attention(q, b.codes, b.scale, b.zero, b.basis, b.mean, bad, *args[5:])
    with pytest.raises(RuntimeError, match="rope must be 0 .none., 1 .per token. or 2 .per block., got 3"):
        pca_quant_attention(q, b.codes, *args[:9], 3, *args[10:])
    for skip in ([[5, 3], [1, 2]], [[1, 10 ** 6], [1, 2]]):  # descending; past the coded tokens
        skip = torch.tensor(skip, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="skip must hold ascending token indices"):
            pca_quant_attention(q, b.codes, *args[:7], skip, *args[8:])


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="block must be a multiple of 8"):
        PCAQuantConfig(block=100)
    with pytest.raises(ValueError, match="cannot be reached at .* tokens"):
        _store(budget=0.05, T=300, residual=64, block=128)
    with pytest.raises(ValueError, match="key_rope='pre' needs a layer with RoPE"):
        PCAQuantStore(anchor_layout(rope=False), PCAQuantConfig(key_rope="pre"))


@pytest.mark.parametrize("blocks,G,widths", [(37, 64, [8, 8, 7, 6, 5, 5, 4, 3, 3, 2, 2, 1]), (5, 24, [4, 4, 2]),
                                             (1, 8, [3])])
def test_native_block_coding_writes_the_pytorch_paths_bits(blocks, G, widths):
    """``kvpack::pca_quant_encode``'s CPU kernel against its PyTorch path: the same codes, scales and zero points,
    bit for bit, on coefficients with ties at code boundaries (values on the fp16 grid), constant components (a
    zero scale) and negative ranges; a width of every size 1..8."""
    from kvpack.attention.pca_encode import pca_quant_encode

    if native() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(3)
    C = len(widths)
    c = torch.randn(blocks, G, C, generator=g) * torch.logspace(1, -3, C)
    c[:, :, 1 % C] = c[:, :, 1 % C].half().float()  # values on the fp16 grid: exact ties between levels
    c[0, :, 2 % C] = -0.75  # a constant component: its scale rounds to 0
    w = torch.tensor(widths, dtype=torch.int32)
    # the CPU kernel, registered when the library loaded (not the op's default implementation)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvpack::pca_quant_encode", "CPU")
    got = pca_quant_encode(c, w)
    from kvpack.attention.pca_blocks import width_groups
    from kvpack.ops.bitpack import pack_bitstream_fast

    # the PyTorch path, spelled out (encode_blocks_reference, the op's default, which the kernel replaces on CPU)
    codes, scale, zero = quantize_minmax(c, dim=1, bits=w.long())
    codes = codes.transpose(1, 2)
    runs, j = [], 0
    for width, count in width_groups(w.reshape(1, 1, -1))[0]:
        runs.append(pack_bitstream_fast(codes[:, j:j + count].contiguous(), width).reshape(blocks, -1))
        j += count
    assert got[0].shape == (blocks, G * sum(widths) // 8)
    assert torch.equal(got[0], torch.cat(runs, dim=1))
    assert torch.equal(got[1].float(), scale[:, 0].float()) and torch.equal(got[2].float(), zero[:, 0].float())


def test_native_block_coding_refuses_bad_layouts():
    if native() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    c = torch.randn(2, 16, 3)
    with pytest.raises(RuntimeError, match="non-increasing"):
        torch.ops.kvpack.pca_quant_encode(c, torch.tensor([2, 4, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="widths must be 1..8"):
        torch.ops.kvpack.pca_quant_encode(c, torch.tensor([9, 4, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.kvpack.pca_quant_encode(torch.randn(2, 12, 3), torch.tensor([4, 4, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"\[blocks, G, C\] fp32"):
        torch.ops.kvpack.pca_quant_encode(c.double(), torch.tensor([4, 4, 1], dtype=torch.int32))
