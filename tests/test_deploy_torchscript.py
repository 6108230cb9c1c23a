"""TorchScript in Python: scripted and traced models that call torch.ops.attn_ext.* are saved,
then loaded and run in a fresh process that either only loads the op library
(torch.ops.load_library) or only imports attn_ext. Outputs equal the eager model's."""

import os

import pytest
import torch

import attn_ext
from deploy_utils import JIT_DEPRECATION, TRACER_TABLE_WARNING, rope_attention, run_python, tiny_gpt

pytestmark = [pytest.mark.filterwarnings(JIT_DEPRECATION),
              pytest.mark.filterwarnings(TRACER_TABLE_WARNING)]

# The loader: prepare the ops one way or the other, then run every saved model on its input.
_LOADER = r"""
import sys, warnings
warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)  # see deploy_utils
import torch
how, folder, names = sys.argv[1], sys.argv[2], sys.argv[3:]
if how == "load_library":
    torch.ops.load_library(open(folder + "/libpath.txt").read())
    assert "attn_ext" not in sys.modules
else:
    import attn_ext
    assert attn_ext.__file__.startswith(open(folder + "/pkgdir.txt").read())
with torch.inference_mode():
    for name in names:
        model = torch.jit.load(f"{folder}/{name}.pt")
        torch.save(model(torch.load(f"{folder}/{name}.in")), f"{folder}/{name}.{how}.out")
print("ok")
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Scripted + traced TinyGPT (RoPE, causal) and MultiHeadAttention (RoPE, GQA), saved with
    inputs of lengths other than the traced one, plus the eager outputs."""
    folder = tmp_path_factory.mktemp("torchscript")
    gpt, mha = tiny_gpt(), rope_attention()
    idx = torch.randint(0, 100, (2, 13))
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        models = {
            "gpt_script": (torch.jit.script(gpt), idx),
            "gpt_trace": (torch.jit.trace(gpt, (torch.randint(0, 100, (1, 5)),)), idx),
            "mha_script": (torch.jit.script(mha), x),
            "mha_trace": (torch.jit.trace(mha, (torch.randn(2, 6, 32),)), x),
        }
        expected = {"gpt_script": gpt(idx), "gpt_trace": gpt(idx),
                    "mha_script": mha(x), "mha_trace": mha(x)}
    for name, (module, inp) in models.items():
        module.save(str(folder / f"{name}.pt"))
        torch.save(inp, folder / f"{name}.in")
    (folder / "libpath.txt").write_text(attn_ext.library_path())
    (folder / "pkgdir.txt").write_text(os.path.dirname(attn_ext.__file__))
    return folder, expected


def test_scripted_models_match_eager_in_process(saved):
    folder, expected = saved
    for name in expected:
        loaded = torch.jit.load(str(folder / f"{name}.pt"))
        with torch.no_grad():
            got = loaded(torch.load(folder / f"{name}.in"))
        torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["load_library", "import"])
def test_saved_models_run_in_a_fresh_process(saved, how):
    folder, expected = saved
    out = run_python(_LOADER, how, str(folder), *expected, with_package=how == "import")
    assert out.strip() == "ok"
    for name, want in expected.items():
        got = torch.load(folder / f"{name}.{how}.out")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_scripted_tinygpt_keeps_grad_path():
    """The scripted model also trains: same loss gradient as eager (out-of-place RoPE)."""
    gpt = tiny_gpt(seed=3)
    scripted = torch.jit.script(gpt)
    idx = torch.randint(0, 100, (2, 9))
    gpt(idx).square().mean().backward()
    scripted(idx).square().mean().backward()
    for (name, p), q in zip(gpt.named_parameters(), scripted.parameters()):
        # script shares the parameters, so the two backwards accumulate: 2x eager's grad
        assert p is q or torch.equal(p, q)
    grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    gpt(idx).square().mean().backward()
    for n, p in gpt.named_parameters():
        torch.testing.assert_close(grads[n], 2 * p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_trace_with_grad_enabled_records_one_graph():
    """torch.jit.trace outside no_grad: the trace checker reruns the model without grad, so
    RoPE must not switch between its in-place and out-of-place ops while tracing (it takes
    the out-of-place one); the traced model matches eager and still trains."""
    gpt = tiny_gpt(seed=5)
    traced = torch.jit.trace(gpt, (torch.randint(0, 100, (2, 10)),))  # check_trace on
    idx = torch.randint(0, 100, (2, 10))
    torch.testing.assert_close(traced(idx), gpt(idx), rtol=1e-5, atol=1e-6)
    traced(idx).square().mean().backward()
    assert all(p.grad is not None for p in gpt.parameters() if p.requires_grad)


class _FirstOutput(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def test_trace_refuses_attention_dropout_and_traces_it_in_eval():
    """torch.jit.trace would keep one dropout draw as constants (one mask forever, and the
    trace checker fails on "graphs differed"): a train-mode layer with dropout, or the
    functional attention with dropout_p > 0, refuses it clearly; in eval mode the layer traces
    and matches eager. (torch.jit.script draws a fresh seed per call.)"""
    torch.manual_seed(0)
    layer = attn_ext.MultiHeadAttention(32, 4, dropout=0.3).train()
    wrapped = _FirstOutput(layer)
    x = torch.randn(2, 6, 32)
    with pytest.raises(RuntimeError, match="attention dropout cannot be traced by torch.jit.trace"):
        torch.jit.trace(wrapped, (x,), check_trace=False)
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(RuntimeError, match="attention dropout cannot be traced"):
        torch.jit.trace(lambda t: attn_ext.attention(t, t, t, dropout_p=0.5), (q,), check_trace=False)
    wrapped.eval()
    traced = torch.jit.trace(wrapped, (x,))
    torch.testing.assert_close(traced(x), layer(x)[0], rtol=0, atol=0)
    scripted = torch.jit.script(layer.train())
    torch.manual_seed(1)
    a = scripted(x)[0]
    torch.manual_seed(1)
    torch.testing.assert_close(scripted(x)[0], a, rtol=0, atol=0)
    assert not torch.equal(scripted(x)[0], a)  # the next call draws a new mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scripted_rope_tables_equal_eager(dtype):
    """A scripted RotaryEmbedding builds the same bits as eager, far out (TorchScript's
    torch.tensor(List[float]) rounds through float32: the tables used to differ by 1e-4 at
    position 10000), and a scripted float64 layer with RoPE gives eager's output exactly."""
    for scaling in (None, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}):
        eager = attn_ext.RotaryEmbedding(64, max_seq_len=16, scaling=scaling)
        scripted = torch.jit.script(attn_ext.RotaryEmbedding(64, max_seq_len=16, scaling=scaling))
        for (a, b) in zip(eager.tables(10000, dtype), scripted.tables(10000, dtype)):
            assert torch.equal(a, b), (scaling, (a - b).abs().max().item())
    torch.manual_seed(0)
    mha = attn_ext.MultiHeadAttention(32, 4, rotary=8).to(dtype).eval()
    x = torch.randn(2, 20, 32, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(mha(x)[0], torch.jit.script(mha)(x)[0])


class _CrossRope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = attn_ext.MultiHeadAttention(32, 4, num_kv_heads=2, cross_attention=True, rotary=8)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.mha(x, memory)[0]


def test_traced_cross_attention_with_rope_at_other_lengths():
    """A traced cross-attention layer with RoPE keeps the query/key distance i + (Sk - Sq) - j
    for lengths other than the traced ones (the start offsets used to be baked in as the
    traced max(Sk - Sq, 0): wrong by 0.1-0.2 at Sq > Sk)."""
    torch.manual_seed(0)
    mod = _CrossRope().eval()
    with torch.no_grad():
        traced = torch.jit.trace(mod, (torch.randn(2, 4, 32), torch.randn(2, 6, 32)))
        for sq, sk in ((4, 6), (6, 4), (3, 9), (9, 3), (5, 5)):
            x, m = torch.randn(2, sq, 32), torch.randn(2, sk, 32)
            torch.testing.assert_close(traced(x, m), mod(x, m), rtol=1e-5, atol=1e-6, msg=(sq, sk))


_CACHES = r"""
import sys, warnings
warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)  # see deploy_utils
import torch
import attn_ext
folder = sys.argv[1]
model = torch.jit.load(f"{folder}/gpt_script.pt")
torch.jit.script(attn_ext.KVCache)  # README: before the first new_caches of a fresh process
idx = torch.load(f"{folder}/gpt_script.in")
caches = model.new_caches(idx.size(0), idx.size(1))
with torch.inference_mode():
    first = model(idx[:, :8], caches)
    for c in caches:  # (README: the scripted call does not advance a Python cache's length)
        c.length += 8
    out = torch.cat([first, model(idx[:, 8:], caches)], dim=1)
assert type(caches[0]).__name__ == "KVCache"
torch.save(out, f"{folder}/gpt_script.caches.out")
print("ok")
"""


def test_loaded_model_makes_its_caches_in_a_fresh_process(saved):
    """new_caches on a model reloaded in a fresh process (torch.jit.load) once KVCache is
    scripted there (without it torch raises "KVCache is not found"): a chunked prefill through
    the caches (their lengths advanced in Python, as README says) gives the whole-sequence
    logits."""
    folder, expected = saved
    out = run_python(_CACHES, str(folder), with_package=True)
    assert out.strip() == "ok"
    got = torch.load(folder / "gpt_script.caches.out")
    torch.testing.assert_close(got, expected["gpt_script"], rtol=1e-5, atol=1e-5)
