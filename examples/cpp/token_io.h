// The command line and the output format of the C++ examples (run_model, run_aoti):
//
//   PROGRAM FILE B S TOKEN...   (B * S int64 tokens, row-major)
//
// and the result they print, which tests/deploy_utils.parse_printed_tensor reads:
//
//   shape D0 D1 ...
//   values V0 V1 ...            (row-major, float, 9 significant digits)
#pragma once

#include <ATen/ATen.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace attn_ext_examples {

inline int64_t parse_int(const char* text, const char* what) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (errno == ERANGE) {
    throw std::invalid_argument(std::string(what) + " is out of the int64 range, got '" + text +
                                "'");
  }
  if (end == text || *end != '\0') {
    throw std::invalid_argument(std::string(what) + " must be an integer, got '" + text + "'");
  }
  return static_cast<int64_t>(v);
}

// The tokens (B, S) int64 given as argv[2] = B, argv[3] = S, then B * S tokens (argc >= 4).
inline at::Tensor parse_tokens(int argc, char** argv) {
  const int64_t B = parse_int(argv[2], "B");
  const int64_t S = parse_int(argv[3], "S");
  // (B * S compared without forming a product past int64)
  const int64_t given = argc - 4;
  if (B < 0 || S < 0 || (S == 0 ? given != 0 : (B > given / S || B * S != given))) {
    throw std::invalid_argument("expected B*S = " + std::to_string(B) + " * " +
                                std::to_string(S) + " tokens, got " + std::to_string(given));
  }
  std::vector<int64_t> tokens;
  tokens.reserve(static_cast<size_t>(given));
  for (int i = 4; i < argc; ++i) tokens.push_back(parse_int(argv[i], "TOKEN"));
  return at::from_blob(tokens.data(), {B, S}, at::kLong).clone();
}

inline void print_tensor(const at::Tensor& t) {
  const at::Tensor out = t.contiguous().to(at::kDouble);
  std::printf("shape");
  for (int64_t d : out.sizes()) std::printf(" %lld", static_cast<long long>(d));
  std::printf("\nvalues");
  const double* p = out.data_ptr<double>();
  for (int64_t i = 0; i < out.numel(); ++i) std::printf(" %.9g", p[i]);
  std::printf("\n");
}

}  // namespace attn_ext_examples
