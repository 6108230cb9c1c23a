// Run a TorchScript model that uses torch.ops.attn_ext.* from C++ (no Python).
//
//   run_model MODEL.pt B S TOKEN...        (B * S int64 tokens, row-major)
//
// Loads MODEL.pt with torch::jit::load, calls forward(tokens (B, S) int64) under
// inference mode and prints the output (a Tensor, or the first Tensor of a tuple) as
//
//   shape D0 D1 ...
//   values V0 V1 ...            (row-major, float, 9 significant digits)
//
// The attn_ext ops are registered because this program links libattn_ext_ops.so with
// --no-as-needed (see CMakeLists.txt). Exit status 1 with a message on stderr on any error.
#include <torch/script.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "token_io.h"

namespace {

at::Tensor first_tensor(const c10::IValue& out) {
  if (out.isTensor()) return out.toTensor();
  if (out.isTuple()) {
    const auto& elems = out.toTupleRef().elements();
    if (!elems.empty() && elems[0].isTensor()) return elems[0].toTensor();
  }
  throw std::runtime_error("model output is neither a Tensor nor a tuple starting with a Tensor, got " +
                           out.tagKind());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODEL.pt B S TOKEN... (B*S int64 tokens)\n", argv[0]);
    return 2;
  }
  try {
    const at::Tensor idx = attn_ext_examples::parse_tokens(argc, argv);  // (B, S)

    torch::jit::script::Module model = torch::jit::load(argv[1]);
    model.eval();
    c10::InferenceMode guard;
    attn_ext_examples::print_tensor(first_tensor(model.forward({idx})));
    return 0;
  } catch (const c10::Error& e) {  // op errors: the message without the C++ backtrace
    std::fprintf(stderr, "run_model: error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {  // torch::jit::load errors are std::exception, not c10::Error
    std::fprintf(stderr, "run_model: error: %s\n", e.what());
    return 1;
  }
}
