"""The forward-mode rule for ``scaled_dot_product_attention`` against forward AD through eager attention.

Reference: attention written out as ``softmax(s·QKᵀ + M) V`` with torch's own forward-mode derivatives of
``matmul`` and ``softmax`` (float64). The rule must agree to 1e-12 over causal, boolean and additive masks,
grouped KV heads, and blocks of queries and tiles of keys that do and do not divide the lengths (the online
softmax rescaling across tiles); no ``[B, H, L, S]`` buffer may exist at ``L ≥ 4 × chunk``, and no buffer of
scores past one tile.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lens_callbacks.credit.engines.attention import DEFAULT_KEY_CHUNK, DEFAULT_ROWS, ForwardAttention, attention_jvp
from lens_callbacks.credit.engines.jvp import ForwardADUnsupportedError

TOL = 1e-12


def eager(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Math attention with torch's own forward-mode derivatives (the reference)."""
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * s
    L, S = scores.shape[-2:]
    if is_causal:
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1) @ v


def inputs(B=2, Hq=4, Hkv=4, L=11, S=11, E=5, Ev=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return (r(B, Hq, L, E), r(B, Hkv, S, E), r(B, Hkv, S, Ev)), (r(B, Hq, L, E), r(B, Hkv, S, E), r(B, Hkv, S, Ev))


def reference_jvp(prim, tan, **kw):
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(prim, tan)]
        out = eager(*duals, **kw)
        o, t = fwAD.unpack_dual(out)
        return o.clone(), t.clone()


def rule_jvp(prim, tan, chunk, key_chunk=DEFAULT_KEY_CHUNK, **kw):
    """Through the mode, as the forward-mode engine calls it: F.scaled_dot_product_attention on dual tensors."""
    with fwAD.dual_level(), ForwardAttention(chunk=chunk, key_chunk=key_chunk) as mode:
        duals = [fwAD.make_dual(p, t) for p, t in zip(prim, tan)]
        out = F.scaled_dot_product_attention(*duals, **kw)
        o, t = fwAD.unpack_dual(out)
        assert mode.calls == 1
        return o.clone(), t.clone()


def _bool_mask(B, L, S, seed=3):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, 1, L, S, generator=g) > 0.3
    m[..., 0] = True  # every query attends to something
    return m


def _additive(B, L, S, seed=4):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, 1, L, S, generator=g, dtype=torch.float64)
        + torch.where(_bool_mask(B, L, S, seed), 0.0, float("-inf")).double()
    )


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool_mask": dict(attn_mask=_bool_mask(2, 11, 11)),
    "additive_mask": dict(attn_mask=_additive(2, 11, 11)),
    "scale": dict(is_causal=True, scale=0.37),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 64])  # 3 and 4 do not divide 11, 11 is one block
@pytest.mark.parametrize("key_chunk", [1, 3, 256])  # one key a tile, tiles that do not divide 11, one tile
def test_the_rule_equals_eager_forward_ad(case, chunk, key_chunk):
    prim, tan = inputs()
    kw = CASES[case]
    ref_kw = {("mask" if k == "attn_mask" else k): v for k, v in kw.items()}
    o_ref, t_ref = reference_jvp(prim, tan, **ref_kw)
    o, t = rule_jvp(prim, tan, chunk, key_chunk, **kw)
    assert float((o - o_ref).abs().max()) <= TOL
    assert float((t - t_ref).abs().max()) <= TOL


@pytest.mark.parametrize("chunk", [2, 5, 16])
@pytest.mark.parametrize("key_chunk", [4, 256])
def test_grouped_kv_heads_and_keys_longer_than_queries(chunk, key_chunk):
    prim, tan = inputs(Hq=6, Hkv=2, L=7, S=13)
    o_ref, t_ref = reference_jvp(prim, tan, enable_gqa=True, is_causal=True)
    o, t = rule_jvp(prim, tan, chunk, key_chunk, enable_gqa=True, is_causal=True)
    assert float((t - t_ref).abs().max()) <= TOL and float((o - o_ref).abs().max()) <= TOL
    # torch's own sdpa agrees on the values (the rule's primal is math attention too)
    q, k, v = prim
    assert float((o - F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)).abs().max()) <= TOL


def _window(L, S, width):
    """A sliding window: query i attends keys i - width < j <= i (whole blocks of keys drop out at both ends)."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return (j <= i) & (j > i - width)


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
@pytest.mark.parametrize("key_chunk", [2, 5, 256])
def test_masks_that_leave_out_whole_key_ranges_and_per_head_masks_under_grouped_heads(chunk, key_chunk):
    # per-head boolean mask [B, Hq, L, S] with grouped KV heads; a 2-D window; an additive per-head mask
    prim, tan = inputs(Hq=6, Hkv=2, L=13, S=13)
    g = torch.Generator().manual_seed(5)
    per_head = (torch.rand(2, 6, 13, 13, generator=g) > 0.4) & _window(13, 13, 6)
    per_head[..., 0] = True
    additive = torch.randn(2, 6, 13, 13, generator=g, dtype=torch.float64).masked_fill(~per_head, float("-inf"))
    for mask in (per_head, _window(13, 13, 4), additive):
        o_ref, t_ref = reference_jvp(prim, tan, mask=mask, enable_gqa=True)
        o, t = rule_jvp(prim, tan, chunk, key_chunk, attn_mask=mask, enable_gqa=True)
        assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL


@pytest.mark.parametrize("chunk", [2, 5])
@pytest.mark.parametrize("key_chunk", [4, 256])
def test_an_additive_mask_with_its_own_tangent(chunk, key_chunk):
    prim, tan = inputs(L=9, S=9)
    g = torch.Generator().manual_seed(6)
    mask, dmask = (torch.randn(2, 4, 9, 9, generator=g, dtype=torch.float64) for _ in range(2))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(prim, tan)]
        ref = fwAD.unpack_dual(eager(*duals, mask=fwAD.make_dual(mask, dmask)))
        o_ref, t_ref = ref.primal.clone(), ref.tangent.clone()
    o, t = attention_jvp(
        prim[0], tan[0], prim[1], tan[1], prim[2], tan[2], mask, dmask, chunk=chunk, key_chunk=key_chunk
    )
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL
    # the mask's tangent alone
    zeros = [torch.zeros_like(x) for x in prim]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, z) for p, z in zip(prim, zeros)]
        t_ref = fwAD.unpack_dual(eager(*duals, mask=fwAD.make_dual(mask, dmask))).tangent.clone()
    _, t = attention_jvp(prim[0], None, prim[1], None, prim[2], None, mask, dmask, chunk=chunk, key_chunk=key_chunk)
    assert float((t - t_ref).abs().max()) <= TOL


class _MatmulWork(TorchDispatchMode):
    """Multiply-adds of the matrix products run inside (bmm and mm)."""

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default, torch.ops.aten.baddbmm_.default):
            a, b = args[-2], args[-1]
            self.macs += a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("key_chunk", [5, 16, 256])
def test_a_causal_block_reads_no_key_after_its_last_query(key_chunk):
    # the causal rule skips the keys after each block's last query: about half the products of the full scores
    prim, tan = inputs(B=1, Hq=2, Hkv=2, L=64, S=64, E=8, Ev=8)
    work = {}
    for causal in (False, True):
        w = _MatmulWork()
        with w:
            attention_jvp(
                prim[0], tan[0], prim[1], tan[1], prim[2], tan[2], is_causal=causal, chunk=8, key_chunk=key_chunk
            )
        work[causal] = w.macs
    full = 1 * 2 * 64 * 64 * 8 * 6  # s·QKᵀ, s·Q̇Kᵀ, s·QK̇ᵀ, PV, PV̇, (P∘Ṡ)V over every key
    assert work[False] == full
    assert work[True] == full * sum(min(64, a + 8) for a in range(0, 64, 8)) // (8 * 64)  # keys [0, b) per block
    assert work[True] < 0.6 * full


def test_only_some_inputs_carry_a_tangent():
    (q, k, v), (dq, dk, dv) = inputs()
    for which in ("q", "k", "v"):
        tans = {"q": None, "k": None, "v": None}
        tans[which] = {"q": dq, "k": dk, "v": dv}[which]
        zeros = [tans[n] if tans[n] is not None else torch.zeros_like(x) for n, x in zip("qkv", (q, k, v))]
        _, t_ref = reference_jvp((q, k, v), zeros, is_causal=True)
        _, t = attention_jvp(q, tans["q"], k, tans["k"], v, tans["v"], is_causal=True, chunk=3)
        assert float((t - t_ref).abs().max()) <= TOL, which


def test_a_row_with_nothing_to_attend_to_reads_zeros_as_torch_does():
    prim, tan = inputs(L=4, S=4)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[:, :, 1] = False  # query 1 attends to nothing
    o, t = rule_jvp(prim, tan, 2, attn_mask=mask)
    q, k, v = prim
    assert torch.equal(o[:, :, 1], torch.zeros_like(o[:, :, 1])) and torch.equal(
        t[:, :, 1], torch.zeros_like(t[:, :, 1])
    )
    assert float((o - F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).abs().max()) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("key_chunk", [2, 256])  # 2: a row empty in its first tiles, live in a later one
def test_rows_with_nothing_to_attend_to_under_every_kind_of_mask_read_zeros(chunk, key_chunk):
    # dead rows from a per-head boolean mask under grouped KV heads, from -inf in an additive mask, and
    # from a boolean mask and the causal mask together (neither alone leaves the row empty); the live
    # rows against eager forward AD, the dead rows zero in value and tangent; a 2-D mask too
    prim, tan = inputs(Hq=6, Hkv=2, L=9, S=9)
    g = torch.Generator().manual_seed(7)
    per_head = torch.rand(2, 6, 9, 9, generator=g) > 0.3
    per_head[..., 0] = True
    per_head[0, 4, 5] = False  # batch 0, query head 4 (KV head 1), query 5: nothing
    per_head[1, 0, 2] = False
    additive = torch.randn(2, 6, 9, 9, generator=g, dtype=torch.float64).masked_fill(~per_head, float("-inf"))
    late = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    late[:, :, 3, :6] = False  # query 3 may attend keys 6.. only, all after it under the causal mask
    for mask, causal in ((per_head, False), (additive, False), (late, True), (late[0, 0], True)):
        dead = ~(mask if mask.dtype == torch.bool else mask > float("-inf"))
        if causal:
            dead = dead | ~torch.ones(9, 9, dtype=torch.bool).tril()
        dead = dead.all(-1).expand(2, 6, 9)  # [B, Hq, L]
        assert 0 < int(dead.sum()) < dead.numel()
        o_ref, t_ref = reference_jvp(prim, tan, mask=mask, is_causal=causal, enable_gqa=True)
        o, t = attention_jvp(
            *(x for pair in zip(prim, tan) for x in pair),
            mask,
            is_causal=causal,
            enable_gqa=True,
            chunk=chunk,
            key_chunk=key_chunk,
        )
        live = ~dead
        assert float((o[live] - o_ref[live]).abs().max()) <= TOL and float((t[live] - t_ref[live]).abs().max()) <= TOL
        assert torch.equal(o[dead], torch.zeros_like(o[dead])) and torch.equal(t[dead], torch.zeros_like(t[dead]))


@pytest.mark.parametrize("key_chunk", [2, 256])
def test_a_nan_in_the_inputs_stays_nan(key_chunk):
    # zeros are given for rows the mask leaves empty, never for rows that are NaN for another reason: a NaN
    # query, and a NaN key that only the last tile of keys holds
    prim, tan = inputs(L=6, S=6)
    q, k = prim[0].clone(), prim[1].clone()
    q[0, 1, 2, 0] = float("nan")
    k[1, 0, 5, 0] = float("nan")
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[:, :, 4] = False
    o, t = attention_jvp(q, tan[0], k, tan[1], prim[2], tan[2], mask, chunk=2, key_chunk=key_chunk)
    assert bool(o[0, 1, 2].isnan().all()) and bool(t[0, 1, 2].isnan().all())
    live = torch.tensor([0, 1, 2, 3, 5])
    assert bool(o[1, 0, live].isnan().all()) and bool(t[1, 0, live].isnan().all())
    assert not bool(o[1, 1].isnan().any())  # another head of that row: untouched
    assert torch.equal(o[:, :, 4], torch.zeros_like(o[:, :, 4]))


class _Largest(TorchDispatchMode):
    """The largest buffer made inside (elements); with ``min_last``, only of batched buffers (3-D and up, as the
    scores are) at least that wide in their last dimension."""

    def __init__(self, min_last=0):
        super().__init__()
        self.largest, self.min_last = 0, min_last

    def __enter__(self):
        self.largest = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and (not self.min_last or (x.dim() >= 3 and x.shape[-1] >= self.min_last)):
                self.largest = max(self.largest, x.numel())
        return out


def test_no_full_score_buffer_at_four_times_the_chunk():
    B, H, L, E, chunk = 1, 2, 64, 8, 16  # L = 4 × chunk
    prim, tan = inputs(B=B, Hq=H, Hkv=H, L=L, S=L, E=E, Ev=E)
    watch = _Largest()
    with watch:
        attention_jvp(prim[0], tan[0], prim[1], tan[1], prim[2], tan[2], is_causal=True, chunk=chunk)
    assert watch.largest < B * H * L * L, watch.largest  # the [B, H, L, L] scores never exist
    assert watch.largest <= B * H * chunk * L
    # the watch sees such a buffer where there is one (the test can fail)
    with watch:
        attention_jvp(prim[0], tan[0], prim[1], tan[1], prim[2], tan[2], is_causal=True, chunk=L)
    assert watch.largest >= B * H * L * L


def test_the_block_size_follows_the_element_budget():
    prim, tan = inputs(B=1, Hq=2, Hkv=2, L=40, S=40)
    watch = _Largest()
    with watch:
        attention_jvp(*[x for pair in zip(prim, tan) for x in pair], is_causal=True, block_elements=2 * 40 * 8)
    assert watch.largest <= 2 * 40 * 8  # 8 queries per block


def test_grouped_heads_take_fewer_queries_a_block_by_default():
    # 7 query heads a KV head, as Qwen2's: a default block holds DEFAULT_ROWS // 7 queries, so the grouped
    # product's rows (block × 7) stay near DEFAULT_ROWS, and the value is exact over blocks that do not divide L
    B, Hq, Hkv, L, E = 1, 14, 2, 80, 8
    c = DEFAULT_ROWS // 7
    assert L % c and c < L
    prim, tan = inputs(B=B, Hq=Hq, Hkv=Hkv, L=L, S=L, E=E, Ev=E)
    o_ref, t_ref = reference_jvp(prim, tan, enable_gqa=True)
    watch = _Largest()
    with watch:
        o, t = attention_jvp(*[x for p in zip(prim, tan) for x in p], enable_gqa=True)
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL
    assert watch.largest == B * Hq * c * L  # one block's scores: [B·Hkv, 7·c, L]
    with watch:  # the watch sees a block of every query where there is one (the test can fail)
        attention_jvp(*[x for p in zip(prim, tan) for x in p], enable_gqa=True, chunk=L)
    assert watch.largest == B * Hq * L * L


def test_no_score_buffer_past_one_tile_of_keys():
    # the keys are read a tile at a time: the scores never hold more than [B·H, chunk, key_chunk]
    B, H, L, E, chunk, key_chunk = 1, 2, 64, 8, 16, 8
    prim, tan = inputs(B=B, Hq=H, Hkv=H, L=L, S=L, E=E, Ev=E)
    o_ref, t_ref = reference_jvp(prim, tan, is_causal=True)
    watch = _Largest()
    with watch:
        o, t = attention_jvp(*[x for p in zip(prim, tan) for x in p], is_causal=True, chunk=chunk, key_chunk=key_chunk)
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL
    assert watch.largest == B * H * L * E  # the outputs are the largest buffers: no tile reaches them
    scores = _Largest(min_last=key_chunk + 1)  # buffers wider than a tile in their last dimension
    with scores:
        attention_jvp(*[x for p in zip(prim, tan) for x in p], is_causal=True, chunk=chunk, key_chunk=key_chunk)
    assert scores.largest == 0
    with scores:  # the watch sees wider scores where there are (the test can fail)
        attention_jvp(*[x for p in zip(prim, tan) for x in p], is_causal=True, chunk=chunk, key_chunk=4 * key_chunk)
    assert scores.largest > 0


def test_large_scores_stay_finite_across_tiles():
    # scores near two thousand, growing along the keys: a row spans far more than exp can, and each tile's
    # maximum exceeds the last one's, so the running sums must be rescaled as they go, never overflow
    prim, tan = inputs(L=12, S=12)
    q, k, v = prim
    k = k + torch.linspace(0, 40, 12, dtype=torch.float64)[:, None]  # later keys score higher
    q = q * 20
    o_ref, t_ref = reference_jvp((q, k, v), tan, is_causal=True)
    o, t = attention_jvp(q, tan[0], k, tan[1], v, tan[2], is_causal=True, chunk=5, key_chunk=3)
    assert bool(o.isfinite().all()) and bool(t.isfinite().all())
    assert float((o - o_ref).abs().max()) <= TOL
    assert float((t - t_ref).abs().max()) <= TOL


@pytest.mark.parametrize("autocast", [False, True])
def test_half_precision_and_autocast_as_torch_attention_runs_them(autocast):
    # bfloat16 inputs (given so, or cast by autocast from float32, as torch's attention is): the value and the
    # tangent in bfloat16, against float64 forward AD at the bfloat16-rounded inputs, within one rounding
    prim, tan = inputs(L=9, S=9)
    given = [x.float() if autocast else x.bfloat16() for x in (*prim, *tan)]
    rounded = [x.bfloat16().double() for x in given]
    o_ref, t_ref = reference_jvp(rounded[:3], rounded[3:], is_causal=True)
    with contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        o, t = rule_jvp(given[:3], given[3:], 4, 4, is_causal=True)
        torch_dtype = F.scaled_dot_product_attention(*given[:3], is_causal=True).dtype
    assert o.dtype == t.dtype == torch_dtype == torch.bfloat16
    assert float((o.double() - o_ref).abs().max()) <= 2**-8 * float(o_ref.abs().max())
    assert float((t.double() - t_ref).abs().max()) <= 2**-8 * float(t_ref.abs().max())


def test_float64_under_autocast_stays_float64_as_torch_attention_does():
    prim, tan = inputs(L=7, S=7)
    o_ref, t_ref = reference_jvp(prim, tan, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, t = rule_jvp(prim, tan, 3, 2, is_causal=True)
        torch_dtype = F.scaled_dot_product_attention(*prim, is_causal=True).dtype
    assert o.dtype == t.dtype == torch_dtype == torch.float64
    assert float((o - o_ref).abs().max()) <= TOL and float((t - t_ref).abs().max()) <= TOL


def test_a_bad_key_chunk_is_refused():
    with pytest.raises(ValueError, match="`key_chunk` must be a positive int, got 0"):
        ForwardAttention(key_chunk=0)


def test_attention_dropout_is_refused_by_name():
    from lens_callbacks.credit.engines.attention import AttentionDropoutError

    prim, tan = inputs()
    with pytest.raises(AttentionDropoutError, match="dropout_p=0.1"):
        rule_jvp(prim, tan, 4, dropout_p=0.1)
    assert issubclass(ForwardADUnsupportedError, RuntimeError)


def test_calls_without_tangents_go_to_torch():
    (q, k, v), _ = inputs()
    with ForwardAttention() as mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert mode.calls == 0 and torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
