"""attn_ext: causal self-attention, stride-reading multi-head attention and positional
encodings as fast CPU/CUDA ``torch.ops.attn_ext.*`` operators.

Importing this package loads the compiled op library (``attn_ext._C``), which registers the
ops with PyTorch's dispatcher, then registers their fake kernels and autograd formulas.
"""

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

from . import _C  # noqa: F401  (loads the library: registers torch.ops.attn_ext.*)
from . import ops as _ops  # noqa: F401  (fake kernels + autograd)
from .ops import sinusoidal_pe, sinusoidal_pe_, sinusoidal_table
from .ops import rope, rope_, rope_qk, rope_cache, rope_inv_freq
from .ops import attention, attention_varlen, causal_attention
from .ops import attention_weights
from ._explain import explain
from .modules import (
    KVCache,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
)
from . import models, reference
from . import distributed  # noqa: F401  (context parallelism: attn_ext.distributed.ring_attention)

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
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "TransformerBlock",
    "models",
    "reference",
    "library_path",
]

__version__ = "0.1.0"


def library_path() -> str:
    """Path of the compiled op library, for ``torch.ops.load_library`` in another process."""
    return _C.__file__
