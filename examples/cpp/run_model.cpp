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

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace {

int64_t parse_int(const char* text, const char* what) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text, &end, 10);
  if (errno == ERANGE) {
    throw std::invalid_argument(std::string(what) + " is out of the int64 range, got '" + text + "'");
  }
  if (end == text || *end != '\0') {
    throw std::invalid_argument(std::string(what) + " must be an integer, got '" + text + "'");
  }
  return static_cast<int64_t>(v);
}

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
    const int64_t B = parse_int(argv[2], "B");
    const int64_t S = parse_int(argv[3], "S");
    // (B * S compared without forming a product past int64)
    const int64_t given = argc - 4;
    if (B < 0 || S < 0 || (S == 0 ? given != 0 : (B > given / S || B * S != given))) {
      throw std::invalid_argument("expected B*S = " + std::to_string(B) + " * " +
                                  std::to_string(S) + " tokens, got " + std::to_string(given));
    }
    std::vector<int64_t> tokens;
    tokens.reserve(static_cast<size_t>(B * S));
    for (int i = 4; i < argc; ++i) tokens.push_back(parse_int(argv[i], "TOKEN"));
    at::Tensor idx = torch::from_blob(tokens.data(), {B, S}, torch::kInt64).clone();  // (B, S)

    torch::jit::script::Module model = torch::jit::load(argv[1]);
    model.eval();
    c10::InferenceMode guard;
    at::Tensor out = first_tensor(model.forward({idx})).contiguous().to(torch::kFloat64);

    std::printf("shape");
    for (int64_t d : out.sizes()) std::printf(" %lld", static_cast<long long>(d));
    std::printf("\nvalues");
    const double* p = out.data_ptr<double>();
    for (int64_t i = 0; i < out.numel(); ++i) std::printf(" %.9g", p[i]);
    std::printf("\n");
    return 0;
  } catch (const c10::Error& e) {  // op errors: the message without the C++ backtrace
    std::fprintf(stderr, "run_model: error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {  // torch::jit::load errors are std::exception, not c10::Error
    std::fprintf(stderr, "run_model: error: %s\n", e.what());
    return 1;
  }
}
