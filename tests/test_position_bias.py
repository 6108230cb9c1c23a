"""Builders of the rel_bias table and ALiBi slopes (attn_ext/position_bias.py)."""

import math

import pytest
import torch

from attn_ext.position_bias import RelativePositionBias, alibi_slopes, t5_bucket


def test_alibi_slopes_power_of_two_and_not():
    # Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(k + 1) for k in range(8)]))
    # 12 heads: the 8-head sequence, then every other slope of the 16-head sequence.
    s16 = [2.0 ** (-(k + 1) / 2) for k in range(16)]
    expect = [2.0 ** -(k + 1) for k in range(8)] + s16[0::2][:4]
    assert torch.allclose(alibi_slopes(12), torch.tensor(expect))
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


def _t5_bucket_textbook(i, j, bidirectional, num_buckets, max_distance):
    # T5 (Raffel et al.), written per pair from the paper's description.
    n = i - j
    ret = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            ret += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                          * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_bucket_matches_the_definition(bidirectional):
    d = torch.arange(-300, 301)
    got = t5_bucket(d, bidirectional, 32, 128)
    want = torch.tensor([_t5_bucket_textbook(int(x), 0, bidirectional, 32, 128) for x in d])
    assert torch.equal(got, want)


def test_t5_bucket_matches_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-200, 201)  # memory - query = j - i = -d
    for bidirectional in (False, True):
        hf = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional,
                                                      num_buckets=32, max_distance=128)
        assert torch.equal(t5_bucket(-rel, bidirectional, 32, 128), hf)


# (bidirectional, num_buckets, max_distance, d, bucket) where T5's log formula is a whole
# number: e.g. bidirectional, 18 buckets -> 9 per half, 4 exact, d = -8 (a key after the query):
# 4 + log(8 / 4) / log(128 / 4) * (9 - 4) = 4 + (1 / 5) * 5 = 5 exactly, + 9 for the second
# half = 14. In float64 the product lands just below 1 and truncated to 13 (HF T5 and mesh-tf
# compute in float32 and give 14).
_WHOLE_LOG_BUCKETS = [(True, 18, 128, -8, 14), (True, 38, 16, 12, 14),
                      (False, 36, 32, 24, 27), (False, 54, 64, 36, 36)]


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance,d,bucket", _WHOLE_LOG_BUCKETS)
def test_t5_bucket_where_the_log_formula_is_a_whole_number(bidirectional, num_buckets,
                                                           max_distance, d, bucket):
    assert t5_bucket(torch.tensor([d]), bidirectional, num_buckets, max_distance).item() == bucket
    # the module's table reads that bucket at column max_distance + d
    m = RelativePositionBias(1, max_distance, bidirectional=bidirectional, num_buckets=num_buckets)
    assert m.index[max_distance + d].item() == bucket


def test_t5_bucket_matches_transformers_on_other_configs():
    """Every (num_buckets, max_distance) from 4 to 64 buckets, distances +-400: the buckets of
    Hugging Face's T5 (float32 arithmetic, as the checkpoints were trained)."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-400, 401)
    for bidirectional in (False, True):
        for num_buckets in range(4, 65, 2):
            for max_distance in (9, 16, 17, 32, 50, 64, 100, 128, 256, 1000):
                if max_distance <= (num_buckets // 2 if bidirectional else num_buckets) // 2:
                    continue
                hf = t5.T5Attention._relative_position_bucket(
                    rel, bidirectional=bidirectional, num_buckets=num_buckets,
                    max_distance=max_distance)
                got = t5_bucket(-rel, bidirectional, num_buckets, max_distance)
                assert torch.equal(got, hf), (bidirectional, num_buckets, max_distance)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_per_distance_table_and_gradient(bidirectional):
    torch.manual_seed(0)
    m = RelativePositionBias(3, max_distance=5, bidirectional=bidirectional)
    with torch.no_grad():
        m.weight.normal_()
    t = m()
    assert t.shape == (3, 11)
    for d in range(-5, 6):
        src = d + 5 if bidirectional else max(d, 0)
        assert torch.equal(t[:, 5 + d], m.weight[:, src])
    t.sum().backward()
    # every entry of the table lands on one weight: the gradient counts how many columns use it
    counts = torch.bincount(m.index, minlength=m.weight.shape[1]).float()
    assert torch.equal(m.weight.grad, counts.expand(3, -1))


def test_bucketed_table_gradient_reaches_the_buckets():
    m = RelativePositionBias(2, max_distance=128, bidirectional=True, num_buckets=32)
    t = m()
    assert t.shape == (2, 257)
    w = torch.randn(2, 257)
    (t * w).sum().backward()
    expect = torch.zeros(2, 32).index_add_(1, m.index, w)
    assert torch.allclose(m.weight.grad, expect)
    # every bucket is used by some distance but the 'after the query, distance 0' one (T5
    # puts d = 0 in the first half, so bucket 16 is empty by construction)
    used = torch.bincount(m.index, minlength=32) > 0
    assert used.sum() == 31 and not used[16]
    assert torch.equal(m.weight.grad != 0, used.expand(2, -1))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_heads"):
        RelativePositionBias(0, 4)
    # types too (a float failed inside torch.zeros naming nothing; max_distance=True was taken)
    for args, kw, name in (((2.5,), {}, "num_heads"), ((True,), {}, "num_heads"),
                           ((2, 3.5), {}, "max_distance"), ((2, True), {}, "max_distance"),
                           ((2, 8), {"num_buckets": 4.5}, "num_buckets"),
                           ((2, 8), {"bidirectional": "yes"}, "bidirectional")):
        with pytest.raises(ValueError, match=f"{name} must be"):
            RelativePositionBias(*args, **kw)
    np = pytest.importorskip("numpy")
    r = RelativePositionBias(np.int64(2), np.int64(9), num_buckets=np.int32(8))
    assert (r.num_heads, r.max_distance, r.num_buckets) == (2, 9, 8)
    assert type(r.max_distance) is int
    from attn_ext import alibi_slopes

    assert torch.equal(alibi_slopes(np.int64(4)), alibi_slopes(4))  # numpy ints are ints
    with pytest.raises(ValueError, match="max_distance"):
        RelativePositionBias(2, 0)
    with pytest.raises(ValueError, match="num_buckets"):
        RelativePositionBias(2, 8, bidirectional=True, num_buckets=2)
    # T5's log spacing needs max_distance past the exact buckets (num_buckets // 4
    # bidirectional, // 2 causal): at or below them log(max_distance / max_exact) <= 0 gave
    # inf / NaN bucket indices and an IndexError in forward()
    for bidirectional, num_buckets, max_distance in ((True, 32, 8), (False, 32, 16), (True, 32, 5)):
        with pytest.raises(ValueError, match="max_distance must be greater than the .* exact buckets"):
            RelativePositionBias(2, max_distance, bidirectional=bidirectional, num_buckets=num_buckets)
        with pytest.raises(ValueError, match="max_distance must be greater"):
            t5_bucket(torch.arange(-4, 5), bidirectional, num_buckets, max_distance)
    r = RelativePositionBias(2, 9, bidirectional=True, num_buckets=32)  # one past: fine
    assert int(r.index.min()) >= 0 and int(r.index.max()) < 32 and torch.isfinite(r()).all()
