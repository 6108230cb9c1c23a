// attn_ext::_parallel_threads: how many distinct threads a torch::stable::parallel_for inside
// this library really uses. The kernels parallelise only through torch's own intra-op pool
// (torch::stable::parallel_for, OpenMP inside libtorch): this library links no OpenMP
// runtime of its own. The probe counts thread ids, so it fails if the work ran inline on
// the calling thread.
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "common/registration.h"
#include "common/stable.h"

namespace attn_ext {
namespace {

int64_t parallel_threads(int64_t n) {
  STD_TORCH_CHECK(n >= 1, "n must be >= 1, got ", n);
  std::mutex mu;
  std::set<std::thread::id> seen;
  torch::stable::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    {
      const std::lock_guard<std::mutex> lock(mu);
      seen.insert(std::this_thread::get_id());
    }
    // Keep each chunk busy long enough that no thread can grab every chunk alone.
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * (end - begin)));
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CompositeExplicitAutograd, m) {
  m.impl("_parallel_threads", TORCH_BOX(&parallel_threads));
}

}  // namespace attn_ext
