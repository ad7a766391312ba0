// The operands every linear kernel checks the same way: x as fp32 [M, K] on CPU, and an optional
// bias as fp32 [N] (included; each kernel is built on its own).
#pragma once

#include <ATen/ATen.h>

namespace kvserve {

// x, checked as fp32 [M, K] on CPU, made contiguous.
inline at::Tensor checked_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "x: fp32 [M, K] on CPU");
  return x.contiguous();
}

// The bias as fp32 [N] (`keep` holds it while it is read), or nullptr where there is none.
inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(keep.numel() == N, "bias [N]");
  return keep.data_ptr<float>();
}

}  // namespace kvserve
