// attn_ext::_parallel_threads: how many threads an at::parallel_for inside this library
// really uses. ATen's parallel_for is a header template whose `#pragma omp parallel` is
// compiled into *our* object files, so without -fopenmp it silently runs on one thread.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace attn_ext {
namespace {

int64_t parallel_threads(int64_t n) {
  TORCH_CHECK(n >= 1, "n must be >= 1, got ", n);
  constexpr int kMaxThreads = 1024;
  std::atomic<int> seen[kMaxThreads];
  for (auto& s : seen) s.store(0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && tid < kMaxThreads) seen[tid].store(1);
    // Keep each chunk busy long enough that no thread can grab every chunk alone.
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * (end - begin)));
  });
  int64_t count = 0;
  for (auto& s : seen) count += s.load();
  return count;
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CompositeExplicitAutograd, m) {
  m.impl("_parallel_threads", &parallel_threads);
}

}  // namespace attn_ext
