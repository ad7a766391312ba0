// Tasks of unequal cost split over the threads by their costs, not by their count: the attention
// kernels' tasks read a context, or part of one, and a batch's contexts differ in length. A
// static split of the task range (at::parallel_for) gives each thread as many tasks, and where the
// long contexts sit together (a server's batch in the order its requests came, the oldest
// longest) one thread reads most of the cache while the other waits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvserve {

// body(begin, end) over [0, n) in contiguous ranges, one a thread: thread t takes the tasks whose
// cost starts in its share of the whole, t / T to (t + 1) / T of the summed costs (cost(i) >= 0).
// Which thread runs a task changes nothing a task computes.
template <typename Cost, typename Body>
void parallel_by_cost(int64_t n, const Cost& cost, const Body& body) {
  if (n <= 0) return;
  std::vector<int64_t> before(n + 1, 0);  // before[i]: the costs of tasks 0 .. i - 1
  for (int64_t i = 0; i < n; ++i) before[i + 1] = before[i] + std::max<int64_t>(0, cost(i));
  const int64_t total = before[n];
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  if (total == 0 || threads == 1) {
    at::parallel_for(0, n, 1, body);
    return;
  }
  // task i's thread is before[i] * T / total (never above T - 1: before[i] < total where cost(i) >
  // 0, and tasks of no cost at the end go with the last thread); it never decreases with i
  const auto owner = [&](int64_t i) { return std::min(threads - 1, before[i] * threads / total); };
  std::vector<int64_t> start(threads + 1, n);  // thread t's tasks: [start[t], start[t + 1])
  for (int64_t i = n - 1; i >= 0; --i) start[owner(i)] = i;
  for (int64_t t = threads - 1; t >= 0; --t) start[t] = std::min(start[t], start[t + 1]);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (start[t] < start[t + 1]) body(start[t], start[t + 1]);
  });
}

}  // namespace kvserve
