// Work shared among the calling thread and XLA's CPU thread pool, for the CPU kernels of gdn_jax/csrc/.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace gdn_jax {

// Below this many bytes of work per thread, the threads of XLA's pool are not worth waking.
constexpr int64_t kBytesPerThread = 128 << 10;

// Runs work(i) for every i in [0, items), each item touching about bytes_per_item bytes, in chunks claimed from a
// shared counter by the calling thread and by tasks on XLA's thread pool (as many as the bytes are worth: none for a
// small call). The caller works until every chunk is claimed, then waits only for the chunks other threads claimed:
// a task the pool never starts claims nothing (no deadlock when the caller is the pool's only thread), and one that
// starts late finds nothing left; the shared state outlives the call for such a task. While it waits the caller
// yields its core after a short spin: a task preempted by another process (more threads than cores) then gets the
// core back at once, instead of after the caller's time slice.
template <typename Work>
void ParallelFor(xla::ffi::ThreadPool& threads, int64_t items, int64_t bytes_per_item, const Work& work) {
  if (items <= 0) return;
  struct Shared {
    Work work;
    int64_t items, chunk;
    std::atomic<int64_t> next{0}, done{0};
    Shared(const Work& w, int64_t n) : work(w), items(n), chunk(1) {}
    void Run() {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) * chunk < items;) {
        const int64_t end = std::min(items, (c + 1) * chunk);
        for (int64_t i = c * chunk; i < end; i++) work(i);
        done.fetch_add(end - c * chunk, std::memory_order_release);
      }
    }
  };
  const int64_t worth = items * bytes_per_item / kBytesPerThread - 1;
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>({threads.num_threads(), items - 1, worth}));
  if (helpers == 0) {
    for (int64_t i = 0; i < items; i++) work(i);
    return;
  }
  auto shared = std::make_shared<Shared>(work, items);
  shared->chunk = std::max<int64_t>(1, items / (4 * (helpers + 1)));
  for (int64_t t = 0; t < helpers; t++) threads.Schedule([shared]() { shared->Run(); });
  shared->Run();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < items; spins++) {
    if (spins < 256) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace gdn_jax
