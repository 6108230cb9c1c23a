"""attn_ext: causal self-attention, stride-reading multi-head attention and positional
encodings as fast CPU/CUDA ``torch.ops.attn_ext.*`` operators.

Importing this package loads the compiled op library (``attn_ext._C``: the schemas and the
CPU kernels), then the CUDA kernels (``attn_ext/_C_cuda*.so``) when they were built and this
torch is a CUDA build of the same CUDA major version, then registers the fake kernels and
autograd formulas. ``attn_ext.build_info()`` says what was built and whether (and why not)
the CUDA kernels are loaded. Both libraries use only PyTorch's stable ABI (built for torch
2.11 onward), so they load in any torch >= 2.11, not just the one they were built against.
"""

import glob as _glob
import os as _os

import torch  # noqa: F401  (loads libtorch, whose stable C shims _C calls)


# this package's compiled op library (one file once built; none in an unbuilt source tree)
_C_FILES = _glob.glob(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_C*.so"))


def _registered_by_another_library():
    """The library (a path, or a description) that registered the attn_ext operators in this
    process before this package's _C did, or None. Two libraries registering the one namespace
    (this package's _C and CMakeLists.txt's libattn_ext_ops.so, or two copies of _C) crash the
    process inside torch (a stable-ABI library's second registration is not refused cleanly), so
    the import refuses first. The same file loaded by torch.ops.load_library is the same library."""
    try:  # (~0.3 ms when absent, the usual case; listing every op name took ~3 ms)
        torch._C._dispatch_find_schema_or_throw("attn_ext::rope", "")
    except (RuntimeError, AttributeError):
        return None
    ours = {_os.path.realpath(p) for p in _C_FILES}
    seen = getattr(torch, "_attn_ext_library", None)  # set below by this package's _C import
    if seen is not None:
        return None if _os.path.realpath(seen) in ours else seen
    loaded = {_os.path.realpath(p) for p in getattr(torch.ops, "loaded_libraries", ())}
    if loaded & ours:
        return None
    others = sorted(loaded - ours)
    return ", ".join(others) if others else "another library (not through torch.ops.load_library)"


_other = _registered_by_another_library()
if _other is not None:
    raise ImportError(
        f"the attn_ext operators are already registered in this process by {_other}: load either "
        "the op library (torch.ops.load_library) or import attn_ext, not both (importing attn_ext "
        "alone registers every op and its autograd)")

try:
    from . import _C  # noqa: F401  (loads the library: registers torch.ops.attn_ext.*)
    torch._attn_ext_library = _C.__file__  # (read by _registered_by_another_library)
except ImportError as _e:
    if _C_FILES:
        raise  # the library is there but does not load: torch's own message says why
    raise ImportError(
        f"attn_ext's compiled library (attn_ext/_C*.so) is not in {_os.path.dirname(__file__)}: "
        "this is an unbuilt source tree. Install the package (`pip install .`, or `pip install "
        "--no-build-isolation -e .` for a development build), and import it from outside the "
        "source tree if it was installed non-editable") from _e


def _load_cuda_kernels(BUILD=None):
    """Loads _C_cuda into a CUDA torch of the build's CUDA major; returns (loaded, reason)."""
    if BUILD is None:
        try:
            from ._build_info import BUILD
        except ImportError:
            return False, "no build record (attn_ext/_build_info.py); CUDA kernels not loaded"
    if not BUILD.get("with_cuda"):
        return False, f"built without CUDA kernels: {BUILD.get('reason')}"
    built = BUILD.get("cuda_version")
    running = torch.version.cuda
    if running is None:
        return False, (f"CUDA kernels (CUDA {built}) not loaded: torch {torch.__version__} "
                       "is a CPU build")
    if running.split(".")[0] != str(built).split(".")[0]:
        return False, (f"CUDA kernels not loaded: built for CUDA {built}, but torch "
                       f"{torch.__version__} uses CUDA {running} (major versions differ)")
    here = _os.path.dirname(_os.path.abspath(__file__))
    libs = sorted(_glob.glob(_os.path.join(here, "_C_cuda*.so")))
    if not libs:
        return False, "built with CUDA kernels but attn_ext/_C_cuda*.so is missing"
    try:
        torch.ops.load_library(libs[0])
    except Exception as e:  # noqa: BLE001  (e.g. no CUDA runtime): never break the import
        return False, f"CUDA kernels failed to load ({libs[0]}): {e}"
    return True, f"CUDA kernels loaded (built for CUDA {built}, torch uses CUDA {running})"


_CUDA_LOADED, _CUDA_REASON = _load_cuda_kernels()


def build_info() -> dict:
    """What was compiled and what is loaded: the build torch, whether the CUDA kernels were
    built and are loaded in this process, and why not."""
    try:
        from ._build_info import BUILD
    except ImportError:
        BUILD = {"reason": "unknown (no attn_ext/_build_info.py)"}
    info = dict(BUILD)
    info["built_with_torch"] = info.pop("torch_version", None)
    info["running_torch"] = torch.__version__
    info["running_torch_cuda"] = torch.version.cuda
    info["cpu_library"] = _C.__file__
    info["cuda_loaded"] = _CUDA_LOADED
    info["cuda_status"] = _CUDA_REASON
    return info


from . import ops as _ops  # noqa: F401,E402  (fake kernels + autograd)
from . import _vmap  # noqa: F401,E402  (torch.func.vmap batching rules)
from .ops import sinusoidal_pe, sinusoidal_pe_, sinusoidal_table
from .ops import rope, rope_, rope_qk, rope_cache, rope_inv_freq
from .ops import attention, attention_varlen, causal_attention
from .ops import attention_weights
from ._explain import explain
from .position_bias import RelativePositionBias, alibi_slopes, t5_bucket
from .modules import (
    KVCache,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
    reset_buffers,
)
from . import models, reference
from . import distributed  # noqa: F401  (context parallelism: attn_ext.distributed.ring_attention)
from ._env import check_switches as _check_switches

_check_switches()  # a misspelled switch or a value the kernels do not read: a warning, not silence

__all__ = [
    "attention",
    "attention_varlen",
    "causal_attention",
    "sinusoidal_pe",
    "sinusoidal_pe_",
    "sinusoidal_table",
    "rope",
    "rope_",
    "rope_qk",
    "rope_cache",
    "rope_inv_freq",
    "attention_weights",
    "explain",
    "RelativePositionBias",
    "alibi_slopes",
    "t5_bucket",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "TransformerBlock",
    "reset_buffers",
    "models",
    "reference",
    "library_path",
    "build_info",
]

__version__ = "0.1.0"


def library_path() -> str:
    """Path of the compiled op library, for ``torch.ops.load_library`` in another process."""
    return _C.__file__
