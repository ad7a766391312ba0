// Splits of a range of tasks over the threads that a static split (at::parallel_for: as many
// tasks a thread) would leave unequal.
//
// parallel_by_cost: tasks of unequal cost split by their costs, not by their count: the attention
// kernels' tasks read a context, or part of one, and a batch's contexts differ in length. A
// static split of the task range gives each thread as many tasks, and where the long contexts sit
// together (a server's batch in the order its requests came, the oldest longest) one thread reads
// most of the cache while the other waits.
//
// parallel_stealing: tasks of equal cost whose threads do not run at equal speed: a product's
// runs of weight rows, each read from memory, where one core's reads come in slower than the
// other's for a while, or the OS takes a core for a moment. Each thread takes its static range
// from the front and then the others' from their backs, one task at a time, so that all finish
// within about a task of each other.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
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

// What is left of a thread's range: its first task (the low 32 bits) up to one past its last (the
// high 32), claimed one task at a time from the front by its thread and from the back by the
// others; a line each, so that a thread's claims do not contend with another range's.
struct alignas(64) TaskSpan {
  std::atomic<uint64_t> left;
  static uint64_t pack(int64_t first, int64_t last) {
    return static_cast<uint64_t>(first) | static_cast<uint64_t>(last) << 32;
  }
  // Takes the first task left (from_back false) or the last into `task`; false where none is left.
  bool take(bool from_back, int64_t& task) {
    uint64_t v = left.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t first = static_cast<int64_t>(v & 0xffffffffu), last = static_cast<int64_t>(v >> 32);
      if (first >= last) return false;
      const uint64_t after = from_back ? pack(first, last - 1) : pack(first + 1, last);
      if (left.compare_exchange_weak(v, after, std::memory_order_relaxed)) {
        task = from_back ? last - 1 : first;
        return true;
      }
    }
  }
};

// How parallel_stealing splits n tasks of the grain: over `threads` threads, thread t's range
// [t * chunk, min(n, (t + 1) * chunk)) (n > 0).
struct StealingSplit {
  int64_t threads, chunk;
  StealingSplit(int64_t n, int64_t grain) {
    grain = std::max<int64_t>(1, grain);
    const int64_t most = n / grain + (n % grain != 0);
    threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), most));
    chunk = (n + threads - 1) / threads;
  }
};

// body(i) for every task i in [0, n) exactly once: thread t's range is what at::parallel_for(0,
// n, grain) would give it (contiguous, as many tasks a thread, at most ceil(n / grain) threads);
// each thread runs its own range from the front, then takes tasks from the back of the others'
// until none is left. Which thread runs a task changes nothing a task computes; the tasks' writes
// are seen after the call (the parallel region's end orders them). Run on one thread (or inside a
// parallel region) the tasks run in order, under a ParallelGuard as at::parallel_for's own.
template <typename Body>
void parallel_stealing(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t(1) << 31), "parallel_stealing takes fewer than 2^31 tasks, not ", n);
  const StealingSplit split(n, grain);
  const int64_t threads = split.threads, chunk = split.chunk;
  if (threads == 1 || at::in_parallel_region()) {
    c10::ParallelGuard guard(true);
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // the ranges on the stack for a few threads (a decode step splits about 120 products this way),
  // on the heap for more
  constexpr int64_t kFew = 8;
  TaskSpan few[kFew];
  std::unique_ptr<TaskSpan[]> many(threads > kFew ? new TaskSpan[threads] : nullptr);
  TaskSpan* spans = many ? many.get() : few;
  for (int64_t t = 0; t < threads; ++t) {
    const uint64_t range = TaskSpan::pack(std::min(n, t * chunk), std::min(n, (t + 1) * chunk));
    spans[t].left.store(range, std::memory_order_relaxed);
  }
  // A thread given several ranges (fewer threads launched than asked for) runs each from the front.
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t i;
    for (int64_t t = t0; t < t1; ++t)
      while (spans[t].take(false, i)) body(i);
    for (int64_t k = 1; k < threads; ++k)
      while (spans[(t0 + k) % threads].take(true, i)) body(i);
  });
}

}  // namespace kvserve
