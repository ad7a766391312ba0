// How the decode kernels cut each context into parts along its blocks (flash-decoding): enough
// (sequence, part) tasks to keep every thread busy when the batch is small, none shorter than
// kMinPartTokens, each part an equal share of the blocks holding the positions a query attends
// to. paged_attention.cpp and mla_attention.cpp cut by this one rule and merge the parts' softmaxes
// at the end.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace kvserve {

// The first position a query at L - 1 attends to: its last `window` positions (0: all).
inline int64_t window_begin(int64_t L, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, L - window) : 0;
}

// The most positions any query of the batch attends to (its window's, where there is one).
inline int64_t longest_attended(const int64_t* lens, int64_t B, int64_t window) {
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, lens[b] - window_begin(lens[b], window));
  return longest;
}

constexpr int64_t kMinPartTokens = 64;

// How many parts each context of a batch of B is cut into.
inline int64_t parts_per_sequence(int64_t B, int64_t longest) {
  const int64_t want = (4 * at::get_num_threads() + B - 1) / B;  // about 4 tasks a thread
  return std::max<int64_t>(1, std::min(want, (longest + kMinPartTokens - 1) / kMinPartTokens));
}

// Blocks [pb0, pb1) of part `part` of P of a context attending to positions [first, len): an
// equal share of the blocks holding them (none where pb0 >= pb1: the blocks ran out first).
inline std::pair<int64_t, int64_t> part_blocks(int64_t first, int64_t len, int64_t BS, int64_t P,
                                               int64_t part) {
  const int64_t blk0 = first / BS, nblk = len > first ? (len - 1) / BS - blk0 + 1 : 0;
  const int64_t per = (nblk + P - 1) / P, pb0 = blk0 + part * per;
  return {pb0, std::min(blk0 + nblk, pb0 + per)};
}

}  // namespace kvserve
