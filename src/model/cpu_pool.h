// The project's CPU kernels' one way of spreading work over XLA's own
// intra-op threads (src/model/chunk_attention.cc, src/model/bf16_cast.cc).
#ifndef JADE_CPU_POOL_H_
#define JADE_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jade {

// The state of a task that needs none (`run_all<NoState>`).
struct NoState {};

// Runs body(task, state) for every task in [0, tasks) on XLA's pool and this
// thread (so a busy pool never stalls the call); each thread that works has
// its own default-constructed State.
template <typename State, typename Body>
void run_all(xla::ffi::ThreadPool& pool, int64_t tasks, const Body& body) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  // A helper that starts after every task was taken returns at once,
  // touching only `shared` (kept alive by its own reference).
  auto drain = [shared, tasks, &body]() {
    State state;
    int64_t mine = 0;
    for (int64_t t; (t = shared->next.fetch_add(1)) < tasks; ++mine)
      body(t, state);
    shared->done.fetch_add(mine);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([drain]() { drain(); });
  drain();
  while (shared->done.load() < tasks) std::this_thread::yield();
}

}  // namespace jade

#endif  // JADE_CPU_POOL_H_
