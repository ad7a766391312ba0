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

// The product's output y [M, N]: `out` where one is given (fp32 [M, N], contiguous, on CPU: a
// tensor its caller keeps between calls), else a new tensor of x's options.
inline at::Tensor output_rows(const at::Tensor& out, int64_t M, int64_t N, const at::Tensor& x) {
  if (!out.defined()) return at::empty({M, N}, x.options());
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
              out.size(0) == M && out.size(1) == N && out.is_contiguous(),
              "out: fp32 [M, N] contiguous on CPU");
  return out;
}

}  // namespace kvserve
