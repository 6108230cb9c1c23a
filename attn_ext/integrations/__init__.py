"""Hooks that plug attn_ext's kernels into other libraries.

Nothing here is imported by ``import attn_ext``; each submodule needs its own optional
dependency:

- :mod:`attn_ext.integrations.hf`: Hugging Face transformers (``pip install attn_ext[hf]``).
  ``import attn_ext.integrations.hf`` registers ``attn_implementation="attn_ext"``.
"""
