"""Tests of attn_ext/reference.py itself: hand-computed tiny cases and the textbook's
properties. Everything else is tested against this file, so it must be right."""

import math

import pytest
import torch

from attn_ext import reference as ref

f64 = torch.float64


def test_attention_hand_computed():
    # One head, D = 1, three tokens: scores are q_i * k_j / sqrt(1).
    q = torch.tensor([1.0, 2.0, 0.5], dtype=f64).view(1, 3, 1, 1)
    k = torch.tensor([0.0, 1.0, -1.0], dtype=f64).view(1, 3, 1, 1)
    v = torch.tensor([10.0, 20.0, 30.0], dtype=f64).view(1, 3, 1, 1)
    out, lse = ref.attention_with_lse(q, k, v, causal=True)
    # row 0 sees key 0 only
    assert out[0, 0, 0, 0].item() == pytest.approx(10.0)
    assert lse[0, 0, 0].item() == pytest.approx(0.0)
    # row 1 sees keys 0, 1 with scores 0, 2
    w = torch.softmax(torch.tensor([0.0, 2.0], dtype=f64), 0)
    assert out[0, 1, 0, 0].item() == pytest.approx(float(w[0] * 10 + w[1] * 20))
    assert lse[0, 0, 1].item() == pytest.approx(math.log(1 + math.exp(2.0)))
    # row 2 sees all keys, scores 0, 0.5, -0.5
    w = torch.softmax(torch.tensor([0.0, 0.5, -0.5], dtype=f64), 0)
    assert out[0, 2, 0, 0].item() == pytest.approx(float(w @ torch.tensor([10.0, 20, 30], dtype=f64)))


def test_causal_rows_sum_to_one_and_first_token_attends_to_itself():
    q, k = torch.randn(2, 6, 3, 4, dtype=f64), torch.randn(2, 6, 3, 4, dtype=f64)
    p = ref.attention_probs(q, k, causal=True)  # (B, H, S, S)
    for i in range(6):
        assert torch.allclose(p[..., i, : i + 1].sum(-1), torch.ones((), dtype=f64))
        assert torch.all(p[..., i, i + 1 :] == 0)
    assert torch.all(p[..., 0, 0] == 1)


def test_empty_rows_are_zero_and_nan_is_not_hidden():
    """Sq > Sk causal: the first Sq - Sk rows see no key -> output exactly 0, lse -inf,
    probabilities 0, gradients finite; a NaN in one query row reaches that row only."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 3, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse = ref.attention_with_lse(q, k, v, causal=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    probs = ref.attention_probs(q, k, causal=True)
    assert torch.equal(probs[:, :, :3], torch.zeros_like(probs[:, :, :3]))
    torch.testing.assert_close(probs[:, :, 3:].sum(-1), torch.ones(1, 2, 3, dtype=torch.float64))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    qn = q.detach().clone()
    qn[0, 4, 1, 0] = float("nan")
    out_n = ref.attention(qn, k.detach(), v.detach(), causal=True)
    assert torch.isnan(out_n[0, 4, 1]).all()
    keep = torch.ones_like(out_n, dtype=torch.bool)
    keep[0, 4, 1] = False
    assert torch.equal(out_n[keep], out.detach()[keep])


def test_a_nan_row_reaches_no_gradient_of_a_key_it_cannot_see():
    """A row made NaN by a visible NaN key has probability exactly 0 at its hidden keys, so the
    dv / dk of a key no row sees (padding) stay 0."""
    g = torch.Generator().manual_seed(5)
    q, k, v = [torch.randn(1, 5, 1, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    k[0, 0, 0, 0] = float("nan")  # seen by every row: every row is NaN
    kpm = torch.ones(1, 5, dtype=torch.bool)
    kpm[0, 4] = False
    q, k, v = [t.requires_grad_() for t in (q, k, v)]
    out = ref.attention(q, k, v, causal=True, key_padding_mask=kpm)
    assert torch.isnan(out).all()
    out.sum().backward()
    assert torch.equal(v.grad[0, 4], torch.zeros_like(v.grad[0, 4]))
    assert torch.equal(k.grad[0, 4], torch.zeros_like(k.grad[0, 4]))


def test_a_non_finite_v_at_a_key_a_row_cannot_see_leaves_that_row_alone():
    """DESIGN.md ("Errors"): a key a row cannot see never affects that row. The probability
    there is exactly 0, but 0 * inf = NaN in probs @ v: an inf / NaN in the v of a hidden key
    (a future token under causal, padding, outside a window) made every row NaN."""
    import attn_ext

    g = torch.Generator().manual_seed(7)
    q, k, v = [torch.randn(2, 5, 2, 4, generator=g, dtype=f64) for _ in range(3)]
    clean = ref.attention(q, k, v, causal=True)
    vn = v.clone()
    vn[0, 4, 1, 2] = float("inf")  # key 4: seen by row 4 only (causal)
    vn[1, 3, 0, 0] = float("nan")  # key 3: seen by rows 3 and 4
    vn[1, 3, 0, 1] = -float("inf")
    out = ref.attention(q, k, vn, causal=True)
    # only the (row, head, channel) that see a non-finite value change
    changed = torch.zeros_like(out, dtype=torch.bool)
    changed[0, 4, 1, 2] = True  # (head 1 of batch 0 reads kv head 1 of batch 0)
    changed[1, 3:, 0, :2] = True
    torch.testing.assert_close(out[~changed], clean[~changed], rtol=1e-12, atol=1e-12)
    assert out[0, 4, 1, 2] == float("inf")
    assert torch.isnan(out[1, 3:, 0, 0]).all() and (out[1, 3:, 0, 1] == -float("inf")).all()
    # padding and windows alike; and the kernels agree (NaN / inf in the same places)
    kpm = torch.ones(2, 5, dtype=torch.bool)
    kpm[1, 3] = False
    for kw in ({"key_padding_mask": kpm}, {"window": (1, 0)}, {"causal": True, "window": (0, 0)}):
        out, lse = ref.attention_with_lse(q, k, vn, kw.get("causal", False), None,
                                          kw.get("window"), kw.get("key_padding_mask"))
        vis = ref.visibility_mask(5, 5, kw.get("causal", False), kw.get("window"),
                                  kw.get("key_padding_mask"))
        vis = vis.expand(2, 1, 5, 5)  # (Sq, Sk) or (B, 1, Sq, Sk)
        sees_bad = vis[0, 0, :, 4]  # rows of batch 0 that see key 4
        assert torch.isfinite(out[0][~sees_bad]).all()
        assert torch.isfinite(out[1][~vis[1, 0, :, 3]]).all()
        ours = attn_ext.attention(q, k, vn, **kw)  # the kernels: the same rule
        assert torch.equal(torch.isnan(ours), torch.isnan(out))
        assert torch.equal(torch.isinf(ours), torch.isinf(out))
        fin = torch.isfinite(out)
        torch.testing.assert_close(ours[fin], out[fin], rtol=1e-9, atol=1e-9)


def test_causal_mask_matches_textbook_triu_and_aligns_bottom_right():
    s = 5
    textbook = ~torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    assert torch.equal(ref.causal_mask(s, s), textbook)
    # Sq < Sk: the last query row sees every key (KV-cache decoding).
    m = ref.causal_mask(2, 5)
    assert m[1].all() and m[0].tolist() == [True, True, True, True, False]
    # Sq > Sk: the first rows see nothing -> output 0, lse -inf, no NaN.
    q, k, v = torch.randn(1, 4, 1, 3, dtype=f64), torch.randn(1, 2, 1, 3, dtype=f64), torch.randn(1, 2, 1, 3, dtype=f64)
    out, lse = ref.attention_with_lse(q, k, v, causal=True)
    assert torch.all(out[0, :2] == 0) and torch.isinf(lse[0, 0, :2]).all()
    assert not torch.isnan(out).any()


def test_gqa_equals_repeated_heads():
    q = torch.randn(2, 5, 4, 3, dtype=f64)
    k, v = torch.randn(2, 7, 2, 3, dtype=f64), torch.randn(2, 7, 2, 6, dtype=f64)
    out = ref.attention(q, k, v, causal=True)
    out_rep = ref.attention(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), causal=True)
    assert out.shape == (2, 5, 4, 6)
    assert torch.allclose(out, out_rep)
    # head 3 reads kv head 1
    o3 = ref.attention(q[:, :, 3:4], k[:, :, 1:2], v[:, :, 1:2], causal=True)
    assert torch.allclose(out[:, :, 3:4], o3)


def test_self_attention_without_position_is_permutation_equivariant():
    torch.manual_seed(0)
    mha = ref.MultiHeadAttentionRef(8, 2, causal=False).double()
    x = torch.randn(1, 6, 8, dtype=f64)
    perm = torch.randperm(6)
    assert torch.allclose(mha(x)[:, perm], mha(x[:, perm]))
    # with RoPE the same permutation changes the output
    cos, sin = ref.rope_cache(6, 4)
    y1 = mha(x, rope_tables=(cos, sin, False))[:, perm]
    y2 = mha(x[:, perm], rope_tables=(cos, sin, False))
    assert not torch.allclose(y1, y2)


def test_sinusoidal_table_hand_computed_and_odd_dim():
    pe = ref.sinusoidal_table(3, 5, base=10000.0)
    for pos in range(3):
        for i in range(5):
            w = 1.0 / 10000.0 ** ((i - i % 2) / 5)
            want = math.sin(pos * w) if i % 2 == 0 else math.cos(pos * w)
            assert pe[pos, i].item() == pytest.approx(want, abs=1e-15)


def test_sinusoidal_shift_is_a_rotation_per_frequency_pair():
    d, delta = 16, 7
    pe = ref.sinusoidal_table(50, d)
    for i in range(d // 2):
        w = 1.0 / 10000.0 ** (2 * i / d)
        c, s = math.cos(delta * w), math.sin(delta * w)
        rot = torch.tensor([[c, s], [-s, c]], dtype=f64)  # (sin, cos)(p + delta) = rot @ (sin, cos)(p)
        pair = pe[:, 2 * i : 2 * i + 2]  # (pos, [sin, cos])
        assert torch.allclose(pair[delta:], pair[:-delta] @ rot.T, atol=1e-12)


def test_sinusoidal_dot_product_depends_only_on_distance():
    pe = ref.sinusoidal_table(64, 32)
    gram = pe @ pe.T
    for dist in (0, 1, 5, 20):
        diag = torch.diagonal(gram, offset=dist)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-10)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_score_depends_only_on_relative_position(interleaved):
    d = 8
    cos, sin = ref.rope_cache(64, d)
    q, k = torch.randn(1, 1, 1, d, dtype=f64), torch.randn(1, 1, 1, d, dtype=f64)

    def score(m, n):
        qm = ref.rope(q, cos, sin, offset=m, interleaved=interleaved)
        kn = ref.rope(k, cos, sin, offset=n, interleaved=interleaved)
        return float((qm * kn).sum())

    assert score(10, 3) == pytest.approx(score(30, 23), abs=1e-12)
    assert score(5, 5) == pytest.approx(float((q * k).sum()), abs=1e-12)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-6)


def test_rope_hand_computed_pairings():
    # D = 4, rotary over all: half-split pairs (0, 2), (1, 3); interleaved pairs (0, 1), (2, 3).
    cos, sin = ref.rope_cache(4, 4, base=100.0)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=f64).view(1, 1, 1, 4)
    pos = 3
    th = [pos * 100.0 ** (-0.0), pos * 100.0 ** (-0.5)]
    c, s = [math.cos(t) for t in th], [math.sin(t) for t in th]
    half = ref.rope(x, cos, sin, offset=pos).flatten().tolist()
    assert half == pytest.approx([1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1],
                                  1 * s[0] + 3 * c[0], 2 * s[1] + 4 * c[1]])
    inter = ref.rope(x, cos, sin, offset=pos, interleaved=True).flatten().tolist()
    assert inter == pytest.approx([1 * c[0] - 2 * s[0], 1 * s[0] + 2 * c[0],
                                   3 * c[1] - 4 * s[1], 3 * s[1] + 4 * c[1]])


def test_rope_partial_passes_channels_through_and_positions_forms_agree():
    cos, sin = ref.rope_cache(20, 4)
    x = torch.randn(2, 5, 3, 10, dtype=f64)
    y = ref.rope(x, cos, sin, offset=4)
    assert torch.equal(y[..., 4:], x[..., 4:])
    pos = torch.arange(4, 9)
    assert torch.allclose(ref.rope(x, cos, sin, positions=pos), y)
    assert torch.allclose(ref.rope(x, cos, sin, positions=pos.expand(2, 5)), y)


def test_reference_takes_the_empty_sizes_the_kernels_take():
    """D = 0 with the default scale (1 / sqrt(0): the kernels take 1) and H = Hkv = 0 raised
    ZeroDivisionError in the reference, so a comparison with it could not be written there."""
    import attn_ext

    f64 = torch.float64
    q, v = torch.randn(2, 3, 2, 0, dtype=f64), torch.randn(2, 3, 2, 4, dtype=f64)
    for causal in (False, True):
        out, lse = attn_ext.attention(q, q, v, causal=causal, return_lse=True)
        want, want_lse = ref.attention_with_lse(q, q, v, causal=causal)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
    assert ref.attention_probs(q, q).shape == (2, 2, 3, 3)
    e = torch.randn(2, 3, 0, 8, dtype=f64)
    assert ref.attention(e, e, e).shape == attn_ext.attention(e, e, e).shape == (2, 3, 0, 8)
