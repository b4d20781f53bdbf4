// How the kernels share out their work among threads. A q4 decode step's layers (layers.cpp) run
// inside one OpenMP parallel region, entered once a step: the kernels the layers call take, in
// each thread, the share of the work that at::parallel_for would have given that thread, and the
// threads meet at a barrier before the next kernel reads what they wrote. Called outside that
// region (each kernel as a torch op), share() is at::parallel_for itself. So the work is split
// the same way on both paths, and the same bits come out; what the region saves is a region's
// start and end for every kernel call, some 150 a step of the default model.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace loom {

// Whether this thread is in Loom's parallel region (`Region`): a region of Loom's own, not any
// OpenMP region (torch's at::parallel_for runs its bodies in regions of its own).
inline bool& in_region() {
  thread_local bool inside = false;
  return inside;
}

// Marks the calling thread as in Loom's region while it lives: the first statement of the
// region's body in every thread.
struct Region {
  Region() { in_region() = true; }
  ~Region() { in_region() = false; }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
};

// The threads that share a kernel's work: the region's, or those at::parallel_for would use.
inline int64_t threads() { return in_region() ? omp_get_num_threads() : at::get_num_threads(); }

// f(b, e) over this thread's share of [begin, end), as at::parallel_for(begin, end, grain, f)
// would split it (chunks of ceil(range / used) for used = min(threads, ceil(range / grain))
// threads, the whole range in one thread when it is under grain), then a barrier. f must not
// throw inside the region: an exception cannot leave an OpenMP region, so the callers check
// everything before they enter it.
template <typename F>
void share(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!in_region()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t range = end - begin, all = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t used = range < grain ? 1 : std::min<int64_t>(all, (range + grain - 1) / grain);
  const int64_t chunk = (range + used - 1) / std::max<int64_t>(used, 1), first = begin + me * chunk;
  if (me < used && first < end) f(first, std::min(end, first + chunk));
#pragma omp barrier
}

}  // namespace loom
