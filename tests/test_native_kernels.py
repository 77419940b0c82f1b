"""kvpack's native CPU kernels against the fp64 PyTorch reference, on deliberately odd shapes.

Each kernel is the ``cpu`` kernel of a ``kvpack::`` custom op; the reference is the op's PyTorch path
computed in fp64 from the same stored codes/factors. Shapes: token counts that are not a multiple of
any tile or split (1, 17, 97, 1000), GQA groups of 1, 3 and 4 query rows per KV head, head_dim 64, 128
and 256 (48 where a kernel has a generic path), empty regions (no pages, no tail), splits of a few
tokens. The kernels must build here: CI has a compiler, so a failed build fails these tests instead of
skipping them (``KVPACK_NATIVE=0`` is the one named way to run without them).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

from kvpack.attention import anchor, cpu, pages, ragged_pages
from kvpack.attention.dense import dense_attention, dense_state
from kvpack.attention.pages import puzzle_pages_partials
from kvpack.attention.quantized import kivi_attention, kivi_partial, quantized_blocks_partials
from kvpack.attention.softmax_merge import PartialAttention, dense_partial, finalize, merge_partials
from kvpack.attention.triton import anchor_op, puzzle_ragged_op  # noqa: F401  (declare the ops' schemas)
from kvpack.attention.triton.puzzle_op import puzzle_partial
from kvpack.ops.rope import LlamaRotary, RotaryTable
from kvpack.resident.base import LayerLayout
from kvpack.resident.kivi import KIVIConfig, KIVIStore
from kvpack.resident.puzzle import PuzzleConfig, PuzzleStore
from kvpack.resident.svd import SVDConfig, SVDStore

if cpu.native_disabled():
    pytest.skip(f"{cpu.NATIVE_ENV}=0: the native CPU kernels are turned off", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def built():
    lib = cpu.native()
    assert lib is not None, "the native CPU kernels did not build (see the warning): g++ and ninja are needed"
    return lib


def close(a: PartialAttention, ref: PartialAttention, atol: float = 2e-5) -> None:
    """Same normalised output and the same log-sum-exp (m + log l) as the reference."""
    out, want = finalize(PartialAttention(a.m.double(), a.l.double(), a.o.double())), finalize(ref)
    torch.testing.assert_close(out, want, atol=atol, rtol=1e-4)
    seen = ref.l > 0
    lse, want_lse = a.m.double() + a.l.double().log(), ref.m + ref.l.log()
    torch.testing.assert_close(lse[seen], want_lse[seen], atol=atol, rtol=1e-5)
    assert torch.equal(a.l > 0, seen)


def queries(H: int, group: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(H, group, d, generator=torch.Generator().manual_seed(seed))


# -- dense --------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,group,d,dtype,per", [
    (1, 1, 64, torch.float32, 512), (17, 3, 64, torch.bfloat16, 5), (97, 4, 128, torch.float16, 32),
    (1000, 3, 256, torch.bfloat16, 512), (1000, 1, 48, torch.float32, 7),
])
def test_dense_kernel_matches_fp64_reference(T, group, d, dtype, per):
    g = torch.Generator().manual_seed(T)
    H = 2
    q = queries(H, group, d)
    k, v = (torch.randn(H, T, d, generator=g) * 2).to(dtype), torch.randn(H, T, d, generator=g).to(dtype)
    got = PartialAttention(*dense_attention(q, k, v, d ** -0.5, per))
    close(got, dense_partial(q.double(), k.double(), v.double(), d ** -0.5))


def test_dense_kernel_with_no_tokens_is_the_empty_state():
    q = queries(2, 3, 64)
    m, l, o = dense_attention(q, torch.empty(2, 0, 64), torch.empty(2, 0, 64), 0.125, 64)
    assert torch.isneginf(m).all() and (l == 0).all() and (o == 0).all()


def test_dense_kernel_refuses_mismatched_shapes():
    q = queries(2, 3, 64)
    with pytest.raises(RuntimeError, match="keys must be a contiguous CPU tensor"):
        dense_attention(q, torch.randn(3, 5, 64), torch.randn(3, 5, 64), 0.125, 64)
    with pytest.raises(RuntimeError, match="must match"):
        dense_attention(q, torch.randn(2, 5, 64), torch.randn(2, 5, 64).half(), 0.125, 64)


# -- KIVI ---------------------------------------------------------------------------------------


def kivi_store(bits: int, group: int, d: int, T: int, residual: int, H: int = 2, seed: int = 0) -> KIVIStore:
    g = torch.Generator().manual_seed(seed)
    store = KIVIStore(LayerLayout(0, H, H * 3, d), KIVIConfig(bits=bits, group_size=group, residual=residual,
                                                              attention_backend="torch"))
    store.append(torch.randn(H, T, d, generator=g) * 3 + 1, torch.randn(H, T, d, generator=g))
    return store


@pytest.mark.parametrize("bits,group,d,T,residual,rows", [
    (2, 32, 64, 1000, 128, 3),    # the default shape (AVX-512 path: 16-byte rows)
    (4, 32, 128, 97, 17, 4),      # 4-bit, blocks + a residual that is no multiple of anything
    (2, 64, 256, 200, 0, 1),      # 256-d keys, 64-token groups, no residual: blocks only
    (4, 16, 48, 53, 5, 3),        # 48-d: the generic (table) path
    (2, 32, 64, 20, 128, 3),      # residual only: no block yet
])
def test_kivi_kernel_matches_fp64_reference(bits, group, d, T, residual, rows):
    store = kivi_store(bits, group, d, T, residual)
    H = store.layout.kv_heads
    q = queries(H, rows, d, seed=1)
    view = store.blocks_view()
    ref = quantized_blocks_partials(view, q.double(), 0.1) if store.n_blocks else []
    if store.tail_k.shape[1]:
        ref.append(dense_partial(q.double(), store.tail_k.double(), store.tail_v.double(), 0.1))
    close(kivi_partial(view, q, 0.1, (store.tail_k, store.tail_v)), merge_partials(ref))
    if store.n_blocks:  # a split per block and one per 3 residual tokens
        b = view
        got = kivi_attention(q, b.kq, b.ks, b.kz, b.vq, b.vs, b.vz, store.tail_k, store.tail_v, bits, group,
                             b.value_group, 0.1, 1, 3)
        close(PartialAttention(*got), merge_partials(ref))


def test_kivi_store_native_path_equals_torch_path():
    store = kivi_store(2, 32, 64, 777, 40)
    q = queries(2, 3, 64, seed=3)
    want = merge_partials(store.stored_partials(q.double(), 0.125))
    store.config = dataclasses.replace(store.config, attention_backend="native")
    (got,) = store.stored_partials(q, 0.125)
    close(got, want)


# -- PuzzleKV -------------------------------------------------------------------------------------


def puzzle_store(d: int, T: int, extra: int, H: int, **cfg) -> PuzzleStore:
    g = torch.Generator().manual_seed(T + d)
    layout = LayerLayout(0, H, H * 3, d, rope=RotaryTable(LlamaRotary(d), d))
    store = PuzzleStore(layout, PuzzleConfig(attention_backend="torch", **cfg))
    store.append(torch.randn(H, T, d, generator=g), torch.randn(H, T, d, generator=g))
    if extra:  # decoded tokens: pages factorized since the prefill form the recent set
        store.append(torch.randn(H, extra, d, generator=g), torch.randn(H, extra, d, generator=g))
    return store


def puzzle_reference(store: PuzzleStore, q: torch.Tensor, scaling: float) -> PartialAttention:
    pages = store.pages_view()
    states = puzzle_pages_partials(pages, q.double(), scaling)
    for k, v in ((pages.sink_k, pages.sink_v), (pages.tail_k, pages.tail_v)):
        if k.shape[1]:
            states.append(dense_partial(q.double(), k.double(), v.double(), scaling))
    return merge_partials(states)


CASES = [
    # d, T, extra, H, rows, config
    (64, 1000, 70, 3, 3, {}),
    (64, 1000, 70, 3, 3, {"int4": True}),
    (64, 1000, 70, 3, 3, {"key_rope": "pre"}),
    (64, 1000, 70, 3, 3, {"key_rope": "pre", "int4": True}),
    (128, 97, 0, 2, 4, {"page_size": 16, "rank_k": 5, "rank_v": 7, "storage_dtype": "float32"}),
    (128, 301, 40, 2, 1, {"page_size": 64, "rank_k": 9, "rank_v": 3, "int4": True, "key_rope": "pre"}),
    (256, 200, 0, 1, 4, {"page_size": 32, "rank_k": 17, "rank_v": 11, "storage_dtype": "float16"}),
    (64, 40, 0, 2, 3, {}),  # shorter than sink + window: no page at all
]


@pytest.mark.parametrize("d,T,extra,H,rows,cfg", CASES)
def test_puzzle_kernel_matches_fp64_reference(d, T, extra, H, rows, cfg):
    store = puzzle_store(d, T, extra, H, **cfg)
    q = queries(H, rows, d, seed=2)
    ref = puzzle_reference(store, q, d ** -0.5)
    for pps, tps in ((None, 256), (1, 7)):
        got = puzzle_partial(store.pages_view(), q, d ** -0.5, pages_per_split=pps, tokens_per_split=tps,
                             native=True)
        close(got, ref)


def test_puzzle_store_uses_the_native_kernel_on_auto(monkeypatch):
    """On ``auto`` a CPU store calls the op (whose CPU kernel is the C++ one), never the Triton launcher."""
    import kvpack.attention.triton.puzzle_op as puzzle_op

    store = puzzle_store(64, 500, 0, 2, int4=True)
    monkeypatch.setattr(puzzle_op, "_triton_puzzle_attention", lambda *a: pytest.fail("the Triton launcher ran"))
    store.config = dataclasses.replace(store.config, attention_backend="auto")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (got,) = store.stored_partials(queries(2, 3, 64), 0.125)
    assert [e.name for e in prof.events() if e.name.startswith("kvpack::")] == ["kvpack::puzzle_attention"]
    close(got, puzzle_reference(store, queries(2, 3, 64), 0.125))


# -- puzzle_plus: pages at per-(head, page) ranks -----------------------------------------------------


def ragged_store(H: int, d: int, T: int, seed: int = 0, **cfg):
    from kvpack.resident.puzzle_plus import PuzzlePlusConfig, PuzzlePlusStore

    g = torch.Generator().manual_seed(seed)
    layout = LayerLayout(0, H, H * 3, d, rope=RotaryTable(LlamaRotary(d), d))
    store = PuzzlePlusStore(layout, PuzzlePlusConfig(attention_backend="torch", **cfg))
    # Channels of decaying energy, so the water-filling gives pages different ranks.
    k = torch.randn(H, T, d, generator=g) @ torch.diag(torch.logspace(0.5, -1, d))
    v = torch.randn(H, T, d, generator=g) @ torch.diag(torch.logspace(0.3, -0.5, d))
    q = torch.randn(H * 3, T, d, generator=g)
    store.scaling = d ** -0.5
    store.append(k, v, q=q, out=torch.zeros_like(q))
    return store


@pytest.mark.parametrize("d,T,rows,cfg", [
    (64, 1000, 3, {}),                                                        # the defaults: INT4, pre-RoPE, P = 64
    (64, 1000, 3, {"int4": False, "key_rope": "post", "storage_dtype": "float32", "budget": 0.9}),
    (128, 301, 4, {"page_size": 16, "int4": False, "key_rope": "pre", "budget": 0.9}),
    (32, 400, 1, {"page_size": 24, "int4": True, "key_rope": "post", "budget": 0.6, "rank_step": 2}),
    # pre-RoPE keys rebuilt in register tiles: a page length that leaves a partial tile (22 = 5 x 4 + 2 on
    # AVX-512, 3 x 6 + 2 x 2 on AVX2), the widest head (256, one token a tile), the narrowest (32, eight), a
    # head with no AVX-512 tile (96; AVX2 tiles it: 23 = 3 x 6 + 2 x 2 + 1, INT4 rows of odd code counts) and
    # one with no tile on either (72)
    (64, 300, 4, {"page_size": 22, "key_rope": "pre", "rank_step": 2}),
    (256, 150, 1, {"page_size": 8, "int4": False, "key_rope": "pre", "budget": 0.9}),
    (32, 250, 3, {"page_size": 20, "int4": True, "key_rope": "pre", "budget": 0.5, "rank_step": 2}),
    (96, 200, 3, {"page_size": 18, "int4": False, "key_rope": "pre", "budget": 0.8}),
    (96, 300, 3, {"page_size": 23, "int4": True, "key_rope": "pre", "budget": 0.3, "rank_step": 2}),
    (72, 200, 3, {"page_size": 18, "int4": False, "key_rope": "pre", "budget": 0.8}),
])
def test_puzzle_plus_kernel_matches_fp64_reference(d, T, rows, cfg):
    from kvpack.attention.triton.puzzle_ragged_op import ragged_puzzle_partial

    store = ragged_store(2, d, T, **cfg)
    ranks = torch.cat([store.keys.rank.flatten(), store.values.rank.flatten()])
    assert ranks.unique().numel() > 1  # mixed ranks, or the test would not test them
    pages = store.pages_view()
    q = queries(2, rows, d, seed=5)
    ref = ragged_reference(pages, q, d ** -0.5)
    for pps, tps in ((None, 256), (1, 5)):
        close(ragged_puzzle_partial(pages, q, d ** -0.5, pages_per_split=pps, tokens_per_split=tps, native=True), ref)


def test_puzzle_plus_kernel_refuses_a_corrupted_rank_table():
    from kvpack.attention.triton.puzzle_ragged_op import ragged_puzzle_partial

    store = ragged_store(2, 64, 600, int4=False, key_rope="post", budget=0.9)
    store.keys.offset[0, 0] = 10**6  # an entry pointing far past the factor buffers
    with pytest.raises(RuntimeError, match="beyond the factor buffers"):
        ragged_puzzle_partial(store.pages_view(), queries(2, 3, 64), 0.125, native=True)


# -- pre-RoPE pages rebuilt with bf16 products (dot_precision) ---------------------------------------

needs_bf16 = pytest.mark.skipif(not cpu.bf16_products_available(), reason="this CPU has no AVX-512 BF16")


def ragged_reference(pages, q: torch.Tensor, scaling: float) -> PartialAttention:
    from kvpack.attention.ragged_pages import ragged_pages_partials

    states = ragged_pages_partials(pages, q.double(), scaling)
    for k, v in ((pages.sink_k, pages.sink_v), (pages.tail_k, pages.tail_v)):
        if k.shape[1]:
            states.append(dense_partial(q.double(), k.double(), v.double(), scaling))
    return merge_partials(states)


def test_dot_precision_choice():
    assert cpu.bf16_products("auto", True, torch.uint8)            # INT4 factors: rounding far below their step
    assert cpu.bf16_products("auto", False, torch.bfloat16)        # bf16 factors: exact
    assert not cpu.bf16_products("auto", False, torch.float32)     # fp32 factors keep fp32 products
    assert cpu.bf16_products("bfloat16", False, torch.float32)
    assert not cpu.bf16_products("float32", True, torch.uint8)
    with pytest.raises(ValueError, match="dot_precision"):
        cpu.bf16_products("fp8", True, torch.uint8)
    with pytest.raises(ValueError, match="dot_precision"):
        PuzzleConfig(dot_precision="half")


# bf16 factors round to themselves: the bf16 products are exact, so the fp64 reference's tolerance holds.
# Odd ranks (the pair's zero partner), page lengths that leave partial tiles, every tiled head size.
@needs_bf16
@pytest.mark.parametrize("d,P,rank_k,rows", [(32, 20, 7, 3), (64, 22, 9, 4), (128, 16, 5, 1), (256, 8, 3, 3)])
def test_bf16_products_are_exact_for_bf16_factors(d, P, rank_k, rows):
    store = puzzle_store(d, 300, 30, 2, page_size=P, rank_k=rank_k, rank_v=4, key_rope="pre",
                         storage_dtype="bfloat16")
    q = queries(2, rows, d, seed=3)
    ref = puzzle_reference(store, q, d ** -0.5)
    for pps in (None, 1):
        close(puzzle_partial(store.pages_view(), q, d ** -0.5, pages_per_split=pps, native=True,
                             dot_precision="bfloat16"), ref)


@needs_bf16
@pytest.mark.parametrize("d,T,rows,cfg", [
    (64, 1000, 3, {"int4": False, "key_rope": "pre", "storage_dtype": "bfloat16", "budget": 0.9}),
    (128, 301, 4, {"page_size": 16, "int4": False, "key_rope": "pre", "storage_dtype": "bfloat16", "budget": 0.9}),
])
def test_bf16_products_are_exact_for_bf16_ragged_factors(d, T, rows, cfg):
    from kvpack.attention.triton.puzzle_ragged_op import ragged_puzzle_partial

    store = ragged_store(2, d, T, **cfg)
    q = queries(2, rows, d, seed=5)
    close(ragged_puzzle_partial(store.pages_view(), q, d ** -0.5, native=True, dot_precision="auto"),
          ragged_reference(store.pages_view(), q, d ** -0.5))


def close_bf16(a: PartialAttention, ref: PartialAttention) -> None:
    """The stated bound of bf16 products over INT4 factors: the normalised output's rms error within 1% of
    the reference output's rms and its largest error within 5e-3, the log-sum-exp within 5e-3 (measured
    on the cases below: rms 0.12-0.33%, largest 0.6e-3-2.7e-3)."""
    out, want = finalize(PartialAttention(a.m.double(), a.l.double(), a.o.double())), finalize(ref)
    err = out - want
    assert err.pow(2).mean().sqrt() <= 1e-2 * want.pow(2).mean().sqrt()
    assert err.abs().max() <= 5e-3
    seen = ref.l > 0
    lse, want_lse = a.m.double() + a.l.double().log(), ref.m + ref.l.log()
    torch.testing.assert_close(lse[seen], want_lse[seen], atol=5e-3, rtol=0)


# INT4 factors: R_K's codes are exact in bf16 (its column scales are applied to the rebuilt keys in fp32);
# L_K's code times its fp16 column scale rounds by at most 2^-9 of the entry, against an INT4 step of
# 1/8 of the column's largest entry.
@needs_bf16
@pytest.mark.parametrize("d,T,rows,cfg", [
    (64, 1000, 3, {}),                                                  # puzzle_plus's defaults (INT4, pre, P = 64)
    (64, 300, 4, {"page_size": 22, "key_rope": "pre", "rank_step": 2}),
    (32, 250, 3, {"page_size": 20, "int4": True, "key_rope": "pre", "budget": 0.5, "rank_step": 2}),
    (128, 400, 4, {"page_size": 32, "budget": 0.3}),
])
def test_bf16_products_stay_within_their_bound_for_int4_factors(d, T, rows, cfg):
    from kvpack.attention.triton.puzzle_ragged_op import ragged_puzzle_partial

    store = ragged_store(2, d, T, **cfg)
    pages = store.pages_view()
    q = queries(2, rows, d, seed=5)
    ref = ragged_reference(pages, q, d ** -0.5)
    exact = ragged_puzzle_partial(pages, q, d ** -0.5, native=True, dot_precision="float32")
    close(exact, ref)
    for pps in (None, 1):
        rounded = ragged_puzzle_partial(pages, q, d ** -0.5, pages_per_split=pps, native=True, dot_precision="auto")
        assert not torch.equal(rounded.o, exact.o)  # the bf16 path ran (or this test would test nothing)
        close_bf16(rounded, ref)


@needs_bf16
def test_puzzle_stores_pass_their_dot_precision():
    store = puzzle_store(64, 600, 0, 2, int4=True, key_rope="pre", rank_k=9, rank_v=8)
    q = queries(2, 3, 64)
    got = {}
    for choice in ("float32", "auto"):
        store.config = dataclasses.replace(store.config, attention_backend="native", dot_precision=choice)
        (got[choice],) = store.stored_partials(q, 0.125)
    assert torch.equal(got["float32"].o, puzzle_partial(store.pages_view(), q, 0.125, native=True).o)
    assert not torch.equal(got["auto"].o, got["float32"].o)
    close_bf16(got["auto"], puzzle_reference(store, q, 0.125))


# -- AnchorKV ------------------------------------------------------------------------------------


def anchor_store(method: str, H: int, group: int, d: int, T: int, seed: int = 0, **cfg):
    from kvpack.resident import get_resident_method

    g = torch.Generator().manual_seed(seed)
    layout = LayerLayout(0, H, H * group, d, rope=RotaryTable(LlamaRotary(d), d))
    cfg = {"window": 8, "anchors": 12, **cfg}  # a small fixed cost, so short sequences fit the budget
    store = get_resident_method(method, attention_backend="torch", **cfg).new_store(layout)
    base = torch.randn(H, 6, d, generator=g)  # keys near a few directions, as AnchorKV expects
    pick = torch.randint(0, 6, (H, T), generator=g)
    k = torch.gather(base, 1, pick[..., None].expand(-1, -1, d)) * (0.5 + torch.rand(H, T, 1, generator=g))
    k = k + 0.2 * torch.randn(H, T, d, generator=g)
    v = torch.randn(H, T, d, generator=g)
    q = torch.randn(H * group, T, d, generator=g)
    store.append(k, v, q, store.attend(q, k, v, d ** -0.5))
    return store


@pytest.mark.parametrize("method,H,group,d,T,cfg", [
    ("anchor", 2, 3, 64, 1000, {"budget": 0.3}),
    ("anchor", 1, 4, 128, 333, {"budget": 0.2}),
    ("anchor", 2, 1, 64, 97, {"budget": 0.3, "residual_codec": "naive"}),
    ("anchor_plus", 2, 3, 64, 1000, {"budget": 0.5}),  # past saturation: the 4-bit tier, uint8 indices
    ("anchor_plus", 2, 4, 128, 301, {"budget": 0.25}),
    # the vector decode of the codes: a head of 32 (half a 16-byte load of 2-bit codes) and of 256
    # (several loads per residual, both tiers)
    ("anchor", 1, 3, 32, 200, {"budget": 0.3}),
    ("anchor_plus", 1, 2, 256, 150, {"budget": 0.5}),
    # anchors stored in bf16 / fp16 (a bf16 or fp16 model's cache): the register paths' widening loads
    ("anchor_plus", 2, 3, 64, 600, {"budget": 0.25, "storage_dtype": "bfloat16"}),
    ("anchor", 1, 3, 32, 200, {"budget": 0.3, "storage_dtype": "float16"}),
    # a head of 8, less than AVX-512's 16 lanes: the residuals decoded one code at a time, both tiers
    ("anchor", 2, 3, 8, 300, {"budget": 0.5}),
    ("anchor_plus", 1, 2, 8, 300, {"budget": 0.8}),
])
def test_anchor_kernel_matches_fp64_reference(method, H, group, d, T, cfg):
    from kvpack.attention.triton.anchor_op import anchor_partials

    store = anchor_store(method, H, group, d, T, **cfg)
    segments = store.segment_views()
    assert segments and store.n_compressed
    if method == "anchor_plus" and cfg["budget"] >= 0.5:
        assert segments[0].keys.fine is not None and segments[0].keys.fine.res.numel()  # the tier is exercised
    q = queries(H, group, d, seed=6)
    k_hat, v_hat = store.reconstruct()
    n = store.n_compressed
    ref = dense_partial(q.double(), k_hat[:, :n].double(), v_hat[:, :n].double(), d ** -0.5)
    for bps in (None, 1, 5):
        close(merge_partials(anchor_partials(segments, q, d ** -0.5, blocks_per_split=bps, native=True)), ref,
              atol=5e-5)


def test_anchor_kernel_generic_rotation_equals_the_fast_hadamard():
    """The kernel applies the Sylvester-Hadamard as a fast transform and any other 0/±1 matrix as a
    product: H diag(σ) with signs s ⊙ σ is the same rotation, so both paths must agree."""
    from kvpack.attention.triton.anchor_op import anchor_partials
    from kvpack.ops.residual_codec import DeviceTables

    store = anchor_store("anchor", 2, 3, 64, 700, budget=0.3)
    segments = store.segment_views()
    q = queries(2, 3, 64, seed=2)
    k_hat, v_hat = store.reconstruct()
    n = store.n_compressed
    ref = dense_partial(q.double(), k_hat[:, :n].double(), v_hat[:, :n].double(), 0.125)
    fast = merge_partials(anchor_partials(segments, q, 0.125, native=True))
    close(fast, ref, atol=5e-5)
    codec, cpu_device = segments[0].codec, torch.device("cpu")
    tables = codec.on(cpu_device)
    flip = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0)
    codec._on_device[cpu_device] = DeviceTables(
        tables.matrix, tables.signs * flip, (tables.kernel_matrix.float() * flip).half(), tables.levels)
    try:
        generic = merge_partials(anchor_partials(segments, q, 0.125, native=True))
    finally:
        codec._on_device[cpu_device] = tables
    close(generic, ref, atol=5e-5)


def test_anchor_kernel_refuses_an_index_past_the_anchors():
    from kvpack.attention.triton.anchor_op import anchor_partials

    store = anchor_store("anchor", 2, 3, 64, 400, budget=0.3)
    seg = store.segment_views()[0]
    seg.keys.index[0, 5] = seg.anchor_k.shape[1] + 3
    with pytest.raises(RuntimeError, match="outside the 12 anchors"):
        anchor_partials([seg], queries(2, 3, 64), 0.125, native=True)


# -- SVD ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,T,budget", [(64, 1000, 0.6), (128, 333, 0.25)])
def test_svd_rank_space_path_matches_reference(d, T, budget):
    g = torch.Generator().manual_seed(d)
    store = SVDStore(LayerLayout(0, 2, 6, d), SVDConfig(budget=budget, attention_backend="torch"))
    store.append(torch.randn(2, T, d, generator=g), torch.randn(2, T, d, generator=g))
    q = queries(2, 3, d, seed=4)
    ref = merge_partials(store.history_partials(q.double(), d ** -0.5))
    store.config = dataclasses.replace(store.config, attention_backend="native")
    (got,) = store.history_partials(q, d ** -0.5)
    close(got, ref)


# -- the end of a decode step: stored states + tail + the chunk ------------------------------------


@pytest.mark.parametrize("n_states,T,Q,group,d",
                         [(2, 5, 1, 3, 64), (1, 0, 3, 4, 128), (0, 9, 2, 1, 32), (3, 17, 16, 3, 64)])
def test_chunk_kernel_matches_fp64_reference(n_states, T, Q, group, d):
    from kvpack.attention.chunk_op import native_history_and_chunk
    from kvpack.attention.softmax_merge import attend_history_and_chunk, group_queries

    g = torch.Generator().manual_seed(Q * 7 + T)
    H = 2
    q = torch.randn(H * group, Q, d, generator=g)
    qg = group_queries(q, H)
    stored = [dense_partial(qg, torch.randn(H, 11, d, generator=g), torch.randn(H, 11, d, generator=g), d ** -0.5)
              for _ in range(n_states)]
    k, v = torch.randn(H, Q, d, generator=g), torch.randn(H, Q, d, generator=g)
    tail = (torch.randn(H, T, d, generator=g).bfloat16(), torch.randn(H, T, d, generator=g).bfloat16())
    history = [PartialAttention(*(t.double() for t in st)) for st in stored]
    if T:
        history.append(dense_partial(qg.double(), tail[0].double(), tail[1].double(), d ** -0.5))
    want, merged = attend_history_and_chunk(history, qg.double(), k.double(), v.double(), d ** -0.5, H * group)
    out, m, l = native_history_and_chunk(stored, qg, k, v, d ** -0.5, H * group, tail if T else None)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close((m.double() + l.double().log()), merged.m + merged.l.log(), atol=2e-5, rtol=1e-5)


# -- dispatch -------------------------------------------------------------------------------------


def test_backend_choice():
    cpu_dev, meta = torch.device("cpu"), torch.device("meta")
    assert cpu.use_native("auto", cpu_dev) and cpu.use_native("native", cpu_dev)
    assert not cpu.use_native("torch", cpu_dev) and not cpu.use_native("triton", cpu_dev)
    assert not cpu.use_native("auto", meta)
    with pytest.raises(ValueError, match="native.*CPU kernels"):
        cpu.use_native("native", meta)


def test_fp64_queries_stay_on_the_reference_path():
    q = queries(2, 3, 64).double()
    k = v = torch.randn(2, 9, 64)
    st = dense_state(q, k, v, 0.125, "auto")
    assert st.o.dtype == torch.float64  # the fp64 reference is never routed to the fp32 kernel


def test_build_key_changes_with_the_sources(tmp_path):
    from kvpack.native_build import build_key

    key = build_key(cpu._CSRC, cpu.SOURCES)
    assert len(key) == 16 and key == build_key(cpu._CSRC, cpu.SOURCES)
    fake = tmp_path / "csrc"
    fake.mkdir()
    for name in cpu.SOURCES:
        (fake / name).write_bytes((cpu._CSRC / name).read_bytes())
    (fake / "common.h").write_bytes((fake / "common.h").read_bytes() + b"\n// changed\n")  # a header counts
    assert build_key(fake, cpu.SOURCES) != key


def test_group_sizes_grid():
    # every (GQA group, head_dim) pair the models in transformers use most, at one odd length
    for group, d in itertools.product((1, 3, 4, 8), (64, 128)):
        q = queries(2, group, d)
        k, v = torch.randn(2, 33, d).bfloat16(), torch.randn(2, 33, d).bfloat16()
        close(PartialAttention(*dense_attention(q, k, v, d ** -0.5, 16)),
              dense_partial(q.double(), k.double(), v.double(), d ** -0.5))


def test_every_op_has_its_cpu_kernel_bound_in_cpp():
    """Loading the library binds each op's CPU kernel in C++ (TORCH_LIBRARY_IMPL): the dispatcher holds a
    CPU kernel for it, and it is not a Python function (a custom op's Python kernels sit on the
    CompositeExplicitAutograd key, not on CPU)."""
    import kvpack.attention.chunk_op  # noqa: F401 - the ops' schemas
    import kvpack.attention.dense  # noqa: F401
    import kvpack.attention.quantized  # noqa: F401
    import kvpack.attention.triton.anchor_op  # noqa: F401
    import kvpack.attention.triton.puzzle_op  # noqa: F401
    import kvpack.attention.triton.puzzle_ragged_op  # noqa: F401

    assert cpu.native() is not None
    for op in ("dense_attention", "kivi_attention", "puzzle_attention", "puzzle_ragged_attention",
               "anchor_segment_attention", "chunk_attend"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvpack::{op}", "CPU"), op
        table = torch._C._dispatch_dump_table(f"kvpack::{op}")
        cpu_line = next(line for line in table.splitlines() if line.startswith("CPU:"))
        assert "csrc/bindings.cpp" in cpu_line, cpu_line  # not custom_ops.py (a Python kernel)


@pytest.mark.parametrize("op, names, extra", [
    ("puzzle_attention", "PAGES_OPERANDS", (16, 5, 5, 0.2, False, False, 0, 2, 16, False)),
    ("puzzle_ragged_attention", "RAGGED_OPERANDS", (16, 5, 0.2, False, False, 0, 2, 16, False)),
    ("anchor_segment_attention", "SEGMENT_OPERANDS", ([0.0, 1.0, 2.0, 3.0], 1.0, 0.2, 0, 2)),
])
def test_a_stored_form_is_one_operand_list_whose_length_both_sides_agree_on(op, names, extra):
    """The big forms pass their tensors as one Tensor[] operand; the C++ kernel refuses a list of another
    length by naming the Python tuple that orders it, and counts as many tensors as that tuple names."""
    expected = len(getattr({"PAGES_OPERANDS": pages, "RAGGED_OPERANDS": ragged_pages,
                            "SEGMENT_OPERANDS": anchor}[names], names))
    q = torch.zeros(1, 1, 8)
    assert cpu.native() is not None
    with pytest.raises(RuntimeError, match=names) as err:
        getattr(torch.ops.kvpack, op)(q, [q] * (expected - 1), *extra)
    assert int(re.search(r"expected the (\d+) tensors", str(err.value)).group(1)) == expected
