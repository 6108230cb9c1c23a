// How every translation unit registers its part of the attn_ext namespace: ATTN_EXT_LIBRARY
// (the schemas, csrc/ops.cpp), ATTN_EXT_LIBRARY_IMPL(key, m) (kernels per dispatch key) and
// ATTN_EXT_LIBRARY_FRAGMENT(m) (a schema defined beside its only kernel).
//
// In the Python extension (setup.py) they are the stable ABI's STABLE_TORCH_LIBRARY* macros.
// In the standalone op library (CMakeLists.txt: ATTN_EXT_STANDALONE_LIBRARY) each block first
// asks whether the namespace is free in this process. It is taken when `import attn_ext` (or
// another copy of the library) registered it first; torch's stable registration does not refuse
// a second owner cleanly (the defs then run on a null library: a segfault inside torch while
// torch.ops.load_library loads the file). The library then registers nothing and says so on
// stderr, and the process keeps the ops registered first. (The other order, this library
// loaded before `import attn_ext`, is refused by attn_ext/__init__.py with an ImportError.)
#pragma once

#include "common/stable.h"

#if defined(ATTN_EXT_STANDALONE_LIBRARY)

#include <cstdint>
#include <optional>

namespace attn_ext {
namespace registration {

// True when the attn_ext namespace was free when this library's static initialisers first
// asked (then every block registers), false when another library holds it (then none does).
// Decided once, by the first block to run; defined in csrc/ops.cpp.
ATTN_EXT_HIDDEN bool namespace_is_free();

class ATTN_EXT_HIDDEN GatedLibraryInit final {
  using Library = torch::stable::detail::StableLibrary;

 public:
  GatedLibraryInit(Library::Kind kind, void (*init)(Library&), const char* key,
                   const char* file, uint32_t line) {
    if (!namespace_is_free()) return;
    lib_.emplace(kind, "attn_ext", key, file, line);
    init(*lib_);
  }

 private:
  std::optional<Library> lib_;  // unregisters the block when the library is unloaded
};

}  // namespace registration
}  // namespace attn_ext

#define ATTN_EXT_LIBRARY_BLOCK_(kind, key, m, uid)                                            \
  static void C10_CONCATENATE(attn_ext_library_init_, uid)(                                  \
      torch::stable::detail::StableLibrary&);                                                 \
  static const attn_ext::registration::GatedLibraryInit C10_CONCATENATE(                      \
      attn_ext_library_static_init_, uid)(torch::stable::detail::StableLibrary::Kind::kind,   \
                                          &C10_CONCATENATE(attn_ext_library_init_, uid), key, \
                                          __FILE__, __LINE__);                                \
  void C10_CONCATENATE(attn_ext_library_init_, uid)(torch::stable::detail::StableLibrary & m)

#define ATTN_EXT_LIBRARY(m) ATTN_EXT_LIBRARY_BLOCK_(DEF, nullptr, m, C10_UID)
#define ATTN_EXT_LIBRARY_IMPL(key, m) ATTN_EXT_LIBRARY_BLOCK_(IMPL, #key, m, C10_UID)
#define ATTN_EXT_LIBRARY_FRAGMENT(m) ATTN_EXT_LIBRARY_BLOCK_(FRAGMENT, nullptr, m, C10_UID)

#else

#define ATTN_EXT_LIBRARY(m) STABLE_TORCH_LIBRARY(attn_ext, m)
#define ATTN_EXT_LIBRARY_IMPL(key, m) STABLE_TORCH_LIBRARY_IMPL(attn_ext, key, m)
#define ATTN_EXT_LIBRARY_FRAGMENT(m) STABLE_TORCH_LIBRARY_FRAGMENT(attn_ext, m)

#endif
