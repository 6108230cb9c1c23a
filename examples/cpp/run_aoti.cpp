// Run an AOTInductor package (.pt2) of a model that uses torch.ops.attn_ext.* from C++ (no
// Python).
//
//   run_aoti PACKAGE.pt2 B S TOKEN...      (B * S int64 tokens, row-major)
//
// The package comes from torch.export + torch._inductor.aoti_compile_and_package (see
// README.md, "Deploying"). This program loads it with torch::inductor::AOTIModelPackageLoader,
// runs it on tokens (B, S) int64 under inference mode and prints the first output exactly as
// run_model.cpp does:
//
//   shape D0 D1 ...
//   values V0 V1 ...            (row-major, float, 9 significant digits)
//
// The compiled model calls our ops through AOTInductor's proxy executor, which looks each
// attn_ext::* op up in the dispatcher when the package is loaded. They are registered because
// this program links libattn_ext_ops.so with --no-as-needed (see CMakeLists.txt); without it
// loading fails with "Could not find schema for attn_ext::<op>".
//
// Exit status 2 on a usage error, 1 with a one-line "run_aoti: error: ..." on stderr on any
// other error. An error raised inside the compiled model (e.g. a token id past the vocabulary)
// is also printed, with a C++ backtrace, by AOTInductor's runtime itself before it reaches us.
//
// Input shapes: AOTInductor checks the input against the shapes declared at export (dtype,
// rank, dynamic-dim ranges) only when the environment variable AOTI_RUNTIME_CHECK_INPUTS=1 is
// set; otherwise an input outside them runs unchecked.
//
// This file includes non-stable libtorch headers (AOTIModelPackageLoader is not part of the
// stable ABI): it is built against the exact libtorch it runs with, unlike the op library.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "token_io.h"

namespace {

// An error raised inside the compiled model crosses AOTInductor's C ABI as text: the
// original message followed by the original C++ backtrace. Keep the message.
std::string without_backtrace(const char* what) {
  std::string text(what);
  const size_t at = text.find("\nException raised from");
  return at == std::string::npos ? text : text.substr(0, at);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PACKAGE.pt2 B S TOKEN... (B*S int64 tokens)\n", argv[0]);
    return 2;
  }
  try {
    const at::Tensor idx = attn_ext_examples::parse_tokens(argc, argv);  // (B, S)

    // Unpacks the archive to a temporary directory, dlopens the compiled model and builds the
    // proxy executor for the ops it calls through the dispatcher (ours among them). Throws if
    // the file is not a package or an op is not registered.
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    c10::InferenceMode guard;
    // One input (the tokens) in, the model's outputs back (flattened: a tuple's tensors in
    // order).
    std::vector<at::Tensor> outputs = loader.run({idx});
    if (outputs.empty()) throw std::runtime_error("the package returned no outputs");
    attn_ext_examples::print_tensor(outputs[0]);
    return 0;
  } catch (const c10::Error& e) {  // loader and op errors: the message without the C++ backtrace
    const std::string message = without_backtrace(e.what_without_backtrace());
    std::fprintf(stderr, "run_aoti: error: %s\n", message.c_str());
    return 1;
  } catch (const std::exception& e) {  // the runner rethrows a compiled model's error as this
    const std::string message = without_backtrace(e.what());
    std::fprintf(stderr, "run_aoti: error: %s\n", message.c_str());
    return 1;
  }
}
