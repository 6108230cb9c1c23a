"""attn_ext: causal self-attention, stride-reading multi-head attention and positional
encodings as fast CPU/CUDA ``torch.ops.attn_ext.*`` operators.

Importing this package loads the compiled op library (``attn_ext._C``), which registers the
ops with PyTorch's dispatcher, then registers their fake kernels and autograd formulas.
"""

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

from . import _C  # noqa: F401  (loads the library: registers torch.ops.attn_ext.*)
from . import ops as _ops  # noqa: F401  (fake kernels + autograd)
from .ops import attention, causal_attention, sinusoidal_pe, sinusoidal_pe_, sinusoidal_table
from . import reference

__all__ = [
    "attention",
    "causal_attention",
    "sinusoidal_pe",
    "sinusoidal_pe_",
    "sinusoidal_table",
    "reference",
    "library_path",
]

__version__ = "0.1.0"


def library_path() -> str:
    """Path of the compiled op library, for ``torch.ops.load_library`` in another process."""
    return _C.__file__
