// Every attn_ext schema, once. Kernels live in csrc/cpu/<op>.cpp and csrc/cuda/<op>.cu
// (TORCH_LIBRARY_IMPL per dispatch key); fake kernels and autograd are registered from
// Python in attn_ext/ops.py. Semantics: ../shared/DESIGN.md.
#include <torch/library.h>

TORCH_LIBRARY(attn_ext, m) {
  // ---- positional encodings -------------------------------------------------------------
  // out = x + PE, PE(pos, 2i) = sin(pos / base^(2i/D)), PE(pos, 2i+1) = cos(...), computed on
  // the fly. x: (B, S, D) or (S, D); positions: int64 (S,) or (B, S); else pos = offset + s.
  m.def(
      "sinusoidal_pe("
      "    Tensor x,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    float base=10000.0"
      ") -> Tensor");
  m.def(
      "sinusoidal_pe_("
      "    Tensor(a!) x,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    float base=10000.0"
      ") -> ()");

  // ---- diagnostics ------------------------------------------------------------------------
  // Runs an at::parallel_for over n items and returns how many distinct threads took part:
  // proves the library was built with OpenMP (without -fopenmp it is always 1).
  m.def("_parallel_threads(int n) -> int");
}
