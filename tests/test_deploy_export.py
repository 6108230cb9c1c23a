"""torch.export of TinyGPT (RoPE, causal, GQA) with dynamic batch and sequence dims: the
exported program keeps our ops, runs at other shapes and matches eager; it survives
torch.export.save/load into a fresh process that imports attn_ext. AOTInductor packaging
(aoti_compile_and_package / aoti_load_package) is tested too, opt-in (ATTN_EXT_SLOW=1):
it compiles the whole model to C++ and takes minutes on 2 cores."""

import os

import pytest
import torch
from torch.export import Dim

from deploy_utils import JIT_DEPRECATION, run_python, tiny_gpt

# Both silenced warnings come from torch itself, not from attn_ext: importing inductor (for
# AOTInductor) imports torch.utils.mkldnn, which uses the deprecated @torch.jit.script_method;
# aoti_compile_and_package copies pytree specs and unpickling a LeafSpec trips torch's own
# "isinstance(treespec, LeafSpec) is deprecated" FutureWarning.
pytestmark = [
    pytest.mark.filterwarnings(JIT_DEPRECATION),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]

MAX_LEN = 64  # RoPE cache rows at construction, and the declared maximum of the seq dim


def _export(model):
    idx = torch.randint(0, 100, (2, 8))
    dims = {"idx": {0: Dim("batch", min=1, max=32), 1: Dim("seq", min=2, max=MAX_LEN)}}
    with torch.no_grad():  # as the README exports; RoPE is out of place in an exported program
        return torch.export.export(model, (idx,), dynamic_shapes=dims)


@pytest.fixture(scope="module")
def exported():
    model = tiny_gpt(seed=21, max_len=MAX_LEN, num_kv_heads=2)
    return model, _export(model)


SHAPES = ((2, 8), (3, 17), (1, 5), (4, MAX_LEN))


def _attn_ext_ops(ep):
    return sorted({str(n.target) for n in ep.graph.nodes if "attn_ext" in str(n.target)} |
                  {str(n.args[0]) for n in ep.graph.nodes
                   if n.op == "call_function" and n.args and "attn_ext" in str(n.args[0])})


def test_exported_program_keeps_our_ops_and_matches_eager(exported):
    model, ep = exported
    ops = _attn_ext_ops(ep)
    assert any("attention" in o for o in ops) and any("rope" in o for o in ops), ops
    run = ep.module()
    for b, s in SHAPES:
        idx = torch.randint(0, 100, (b, s))
        with torch.no_grad():
            want = model(idx)
            torch.testing.assert_close(run(idx), want, rtol=1e-5, atol=1e-6)
        # and where autograd records (an exported under no_grad program used to bake in the
        # in-place rope_qk_, which refuses q that requires grad)
        torch.testing.assert_close(run(idx).detach(), want, rtol=1e-5, atol=1e-6)


def test_export_rejects_lengths_past_the_declared_maximum(exported):
    _, ep = exported
    with pytest.raises(Exception, match=f"<= {MAX_LEN}"):  # a shape guard, not a wrong answer
        ep.module()(torch.randint(0, 100, (1, MAX_LEN + 1)))


def test_export_with_an_unbounded_sequence_dim():
    """Issue 7: a dynamic batch and sequence dim, Dim("S") without a maximum. RoPE's tables
    are built in the graph while exporting, so the program runs past the cache's length and
    matches eager (which grows its cache) exactly."""
    model = tiny_gpt(seed=22, max_len=MAX_LEN, num_kv_heads=2)
    idx = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        ep = torch.export.export(model, (idx,), dynamic_shapes={"idx": {0: Dim("B"), 1: Dim("S")}})
        run = ep.module()
        for b, s in ((2, 8), (3, MAX_LEN + 37), (1, 4 * MAX_LEN)):
            idx = torch.randint(0, 100, (b, s))
            torch.testing.assert_close(run(idx), model(idx), rtol=0, atol=0)


_LOAD = r"""
import sys
import torch
import attn_ext  # registers the ops (and their fake kernels) before loading
ep = torch.export.load(sys.argv[1])
run = ep.module()
for i in range(2, len(sys.argv)):
    idx = torch.load(sys.argv[i])
    with torch.no_grad():
        out = run(idx)
    torch.testing.assert_close(run(idx).detach(), out, rtol=0, atol=0)  # grad mode on, too
    torch.save(out, sys.argv[i] + ".out")
print("ok")
"""


def test_export_save_load_in_a_fresh_process(exported, tmp_path):
    model, ep = exported
    path = str(tmp_path / "tinygpt.pt2")
    torch.export.save(ep, path)
    inputs = []
    for i, (b, s) in enumerate(SHAPES):
        p = str(tmp_path / f"idx{i}.pt")
        torch.save(torch.randint(0, 100, (b, s)), p)
        inputs.append(p)
    assert run_python(_LOAD, path, *inputs, with_package=True).strip() == "ok"
    with torch.no_grad():
        for p in inputs:
            torch.testing.assert_close(torch.load(p + ".out"), model(torch.load(p)),
                                       rtol=1e-5, atol=1e-6)


_AOTI_LOAD = r"""
import sys
import torch
import attn_ext  # the package calls torch.ops.attn_ext.* through the dispatcher
runner = torch._inductor.aoti_load_package(sys.argv[1])
for i in range(2, len(sys.argv)):
    torch.save(runner(torch.load(sys.argv[i])), sys.argv[i] + ".out")
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATTN_EXT_SLOW") != "1",
                    reason="AOTInductor compiles the model to C++ for minutes; ATTN_EXT_SLOW=1 runs it")
def test_aoti_package_runs_in_a_fresh_process(exported, tmp_path):
    model, ep = exported
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "tinygpt_aoti.pt2"))
    inputs = []
    for i, (b, s) in enumerate(SHAPES):
        p = str(tmp_path / f"idx{i}.pt")
        torch.save(torch.randint(0, 100, (b, s)), p)
        inputs.append(p)
    assert run_python(_AOTI_LOAD, pkg, *inputs, with_package=True, timeout=600).strip() == "ok"
    with torch.no_grad():
        for p in inputs:
            torch.testing.assert_close(torch.load(p + ".out"), model(torch.load(p)),
                                       rtol=1e-4, atol=1e-5)


def test_wrappers_take_symbolic_sizes_under_export():
    """Non-strict export (torch 2.13's default) hands the wrappers sizes as SymInts: their type
    checks refused them ('max_seqlen_q must be an int, got SymInt'; the same for rope_cache's
    and sinusoidal_table's seq_len), and sinusoidal_table's int() specialised the size. The
    exported programs now keep the dimension dynamic and give eager's results at other sizes."""
    import attn_ext

    class Varlen(torch.nn.Module):
        def forward(self, q, k, v, cu):
            return attn_ext.attention_varlen(q, k, v, cu, cu, q.shape[0], k.shape[0], causal=True)

    class Tables(torch.nn.Module):
        def forward(self, x):
            cos, sin = attn_ext.rope_cache(x.shape[1], 8)
            return attn_ext.rope(x, cos, sin) + attn_ext.sinusoidal_table(x.shape[1], 8)[None, :, None]

    T, S = Dim("T", min=2, max=64), Dim("S", min=2, max=64)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    ep = torch.export.export(Varlen(), (q, k, v, cu), dynamic_shapes=({0: T}, {0: T}, {0: T}, None))
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.testing.assert_close(ep.module()(q, k, v, cu), Varlen()(q, k, v, cu))
    ep = torch.export.export(Tables(), (torch.randn(2, 5, 3, 8),), dynamic_shapes=({1: S},))
    x = torch.randn(2, 11, 3, 8)
    torch.testing.assert_close(ep.module()(x), Tables()(x))
