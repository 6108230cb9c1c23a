"""Read integer constants and lane maps out of the kernels' C++/CUDA sources, so that models
of the kernels (tools/fa2_emulate.py, attn_ext/_explain.py's dispatch rules, tests) take them
from the one place they are defined instead of retyping them.

Understands the small subset of C++ the headers use for these: ``[static] constexpr int[64_t]
NAME = EXPR;`` (also several ``NAME = EXPR`` declarators separated by commas), ``const int
NAME = EXPR;`` lane maps, and expressions of integers, names, ``+ - * / % << >> & |``,
comparisons, ``?:``, ``Tr::NAME`` and ``static_cast<T>(...)``. Anything it cannot find or
evaluate raises, so a renamed constant fails loudly.

    python tools/kernel_constants.py     # print what it reads
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source(rel: str) -> str:
    """The text of ``rel`` (relative to the repository root), comments removed."""
    with open(os.path.join(ROOT, rel)) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def block(text: str, opener: str) -> str:
    """The brace-delimited body that follows the first match of regex ``opener``."""
    m = re.search(opener, text)
    if m is None:
        raise KeyError(f"{opener!r} not found")
    start = text.index("{", m.end() - 1 if text[m.end() - 1] == "{" else m.end())
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError(f"unbalanced braces after {opener!r}")


def _split_top(s: str, sep: str = ",") -> list:
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += {"(": 1, "<": 0, ")": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def _to_python(expr: str) -> str:
    e = re.sub(r"static_cast<[^>]*>", "", expr)
    e = re.sub(r"\b\w+::", "", e)  # Tr::kBlockM, fa2::kBlockM -> kBlockM
    e = re.sub(r"(\d+)(?:LL|ULL|L|U|u|ll)\b", r"\1", e)
    e = e.replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"(?<![/])/(?![/])", "//", e)  # integer division (only ints here)
    # ternaries, innermost parenthesised first, then one at the top level
    tern = re.compile(r"\(([^()?:]*)\?([^()?:]*):([^()?:]*)\)")
    while tern.search(e):
        e = tern.sub(lambda m: f"(({m.group(2)}) if ({m.group(1)}) else ({m.group(3)}))", e)
    m = re.fullmatch(r"([^?:]*)\?([^?:]*):([^?:]*)", e.strip())
    if m:
        e = f"(({m.group(2)}) if ({m.group(1)}) else ({m.group(3)}))"
    if "?" in e:
        raise ValueError(f"cannot translate {expr!r}")
    return e


def evaluate(expr: str, env: Dict[str, object]):
    """Value of the C++ expression ``expr`` with the names in ``env``."""
    return eval(_to_python(expr), {"__builtins__": {}}, dict(env))  # noqa: S307 (our own headers)


def declarations(text: str, kind: str = r"(?:static\s+)?constexpr\s+(?:int|int64_t|auto)") -> list:
    """(name, expr) of every ``kind NAME = EXPR[, NAME = EXPR];`` in ``text``, in order."""
    out = []
    for m in re.finditer(kind + r"\s+(\w+\s*=[^;{}]*);", text):
        for decl in _split_top(m.group(1)):
            name, _, expr = decl.partition("=")
            out.append((name.strip(), expr.strip()))
    return out


def constants(text: str, env: Optional[Dict[str, object]] = None,
              kind: str = r"(?:static\s+)?constexpr\s+(?:int|int64_t)") -> Dict[str, object]:
    """Evaluate the declarations of ``text`` in order, each seeing the ones before it."""
    env = dict(env or {})
    for name, expr in declarations(text, kind):
        env[name] = evaluate(expr, env)
    return env


# ---- what the models of the kernels need -------------------------------------------------

FWD = "csrc/cuda/attention_fwd_kernel.cuh"
BWD = "csrc/cuda/attention_bwd_kernel.cuh"
LAUNCH = "csrc/cuda/attention_launch.h"
CPU_COMMON = "csrc/cpu/attention_common.h"


def traits(path: str, struct: str, head_dim: int) -> Dict[str, int]:
    """``struct``'s static constexpr ints (FwdTraits / BwdTraits) at ``kHeadDim_ = head_dim``."""
    body = block(source(path), r"struct\s+" + struct + r"\s*\{")
    env = constants(body, {"kHeadDim_": head_dim})
    env.pop("kHeadDim_")
    return env


def kernel_locals(path: str, kernel: str, env: Dict[str, int]) -> Dict[str, int]:
    """The ``constexpr int`` locals of ``kernel``'s body, evaluated with the traits ``env``
    (``Tr::X`` resolves to ``env['X']``)."""
    body = block(source(path), r"\b" + kernel + r"\s*\([^)]*\)\s*\{")
    return constants(body, env, r"constexpr\s+int")


def lane_maps(path: str, kernel: str, names, lane):
    """The per-lane ``const int NAME = EXPR;`` index maps of ``kernel``, evaluated for the
    array ``lane`` (numpy: all 32 lanes at once)."""
    body = block(source(path), r"\b" + kernel + r"\s*\([^)]*\)\s*\{")
    decls = dict(declarations(body, r"const\s+int"))
    missing = [n for n in names if n not in decls]
    if missing:
        raise KeyError(f"lane maps {missing} not found in {kernel} ({path})")
    env = {"lane": lane}
    return {n: evaluate(decls[n], env) for n in names}


def fwd_fast_head_dims() -> tuple:
    """Head dims of fa2::fwd_fast_head_dim (the fast forward kernels that are built)."""
    body = block(source(LAUNCH), r"bool\s+fwd_fast_head_dim\s*\([^)]*\)\s*\{")
    dims = tuple(int(x) for x in re.findall(r"\bd\s*==\s*(\d+)", body))
    if not dims:
        raise KeyError("fwd_fast_head_dim: no head dim found")
    return dims


def bwd_fast_head_dims() -> tuple:
    """Head dims of fa2::launch_fa2_bwd (the fast backward kernels that are built)."""
    body = block(source(LAUNCH), r"cudaError_t\s+launch_fa2_bwd\s*\([^)]*\)\s*\{")
    dims = tuple(sorted({int(x) for x in re.findall(r"\.D\s*[!=]=\s*(\d+)", body)}))
    if not dims:
        raise KeyError("launch_fa2_bwd: no head dim found")
    return dims


def launch_function(name: str) -> str:
    """Return expression of the one-line ``constexpr int name(int64_t head_dim)`` helper."""
    body = block(source(LAUNCH), r"constexpr\s+int\s+" + name + r"\s*\(\s*int64_t\s+head_dim\s*\)\s*\{")
    m = re.search(r"return\s+(.*);", body, flags=re.S)
    if m is None:
        raise KeyError(f"{name}: no return statement")
    return " ".join(m.group(1).split())


def launch_constants() -> Dict[str, int]:
    """Namespace-level constexprs of attention_launch.h, as ``simple.NAME`` / ``fa2.NAME``."""
    text = source(LAUNCH)
    out = {}
    for ns in ("simple", "fa2"):
        body = block(text, r"namespace\s+" + ns + r"\s*\{")
        for name, value in constants(body, kind=r"constexpr\s+int").items():
            out[f"{ns}.{name}"] = value
    return out


def cpu_constants() -> Dict[str, int]:
    """kBlockQ / kBlockK ... of csrc/cpu/attention_common.h."""
    return constants(source(CPU_COMMON), kind=r"constexpr\s+int64_t")


if __name__ == "__main__":
    import numpy as np

    for d in fwd_fast_head_dims():
        print("FwdTraits", d, traits(FWD, "FwdTraits", d))
    for d in bwd_fast_head_dims():
        print("BwdTraits", d, traits(BWD, "BwdTraits", d))
    print("fwd lane maps", lane_maps(FWD, "fa2_fwd_kernel", ["lrow", "lcol", "krow", "kcol"], np.arange(32)))
    print("launch", launch_constants(), launch_function("fwd_smem_bytes"), launch_function("bwd_smem_bytes"))
    print("cpu", cpu_constants())
