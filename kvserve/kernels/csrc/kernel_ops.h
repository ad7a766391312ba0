// Operations one compiled kernel hands another, its operands bound: a product (y = x @ W^T of a
// packed weight) or a decode attention over one layer's cache. Each kernel is built as a module of
// its own; a decoder layer run as one call (layer_ops' DecodeLayer) calls the products and the
// attention of the other modules through these, in a Python capsule that owns the operation,
// without a Python call between them (included; each kernel is built on its own).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace kvserve {

// y [M, N] fp32 = x [M, K] fp32 @ W^T (+ bias), what the kernel's own entry gives for x.
struct RowsOp {
  virtual ~RowsOp() = default;
  virtual at::Tensor operator()(const at::Tensor& x) const = 0;
  // N: the columns of y.
  virtual int64_t out_features() const = 0;
  // The same y written into out (fp32 [M, N], contiguous), for a caller that keeps its outputs
  // between calls.
  virtual void into(const at::Tensor& x, const at::Tensor& out) const = 0;
};

// Decode attention of q [B, H, D] over one layer's cache through the block tables [B, max blocks]
// to each context's length in lens [B] (window 0: the whole context): [B, H, D].
struct DecodeOp {
  virtual ~DecodeOp() = default;
  virtual at::Tensor operator()(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                                int64_t window) const = 0;
  // The same written into out (q's dtype, [B, H, D] contiguous).
  virtual void into(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens, int64_t window,
                    const at::Tensor& out) const = 0;
};

// A product kernel's entry that takes (x, W, its format, K, bias, out) and returns y, in out
// where it is defined (else a new tensor), with W and the rest bound.
using ProductFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                 const c10::optional<at::Tensor>&, const at::Tensor&);
struct BoundProduct final : RowsOp {
  ProductFn fn;
  at::Tensor w;
  int64_t fmt, K;
  c10::optional<at::Tensor> bias;
  BoundProduct(ProductFn fn, at::Tensor w, int64_t fmt, int64_t K, c10::optional<at::Tensor> bias)
      : fn(fn), w(std::move(w)), fmt(fmt), K(K), bias(std::move(bias)) {}
  at::Tensor operator()(const at::Tensor& x) const override { return fn(x, w, fmt, K, bias, {}); }
  int64_t out_features() const override { return w.size(0); }  // W [N, a row's bytes] in these kernels
  void into(const at::Tensor& x, const at::Tensor& out) const override { fn(x, w, fmt, K, bias, out); }
};

template <typename Op>
constexpr const char* capsule_name();
template <>
constexpr const char* capsule_name<RowsOp>() { return "kvserve.RowsOp"; }
template <>
constexpr const char* capsule_name<DecodeOp>() { return "kvserve.DecodeOp"; }

// A capsule that owns op (deleted with the capsule, by the module that made it).
template <typename Op>
pybind11::capsule to_capsule(std::unique_ptr<Op> op) {
  return pybind11::capsule(op.release(), capsule_name<Op>(), [](PyObject* o) {
    delete static_cast<Op*>(PyCapsule_GetPointer(o, capsule_name<Op>()));
  });
}

// The operation in a capsule made by to_capsule<Op> (a TypeError for any other object).
template <typename Op>
const Op* from_capsule(const pybind11::object& o) {
  if (!PyCapsule_IsValid(o.ptr(), capsule_name<Op>()))
    throw pybind11::type_error(std::string("expected a ") + capsule_name<Op>() + " capsule");
  return static_cast<const Op*>(PyCapsule_GetPointer(o.ptr(), capsule_name<Op>()));
}

// fn with its operands bound, in a capsule (a kernel's rows_op).
inline pybind11::capsule product_capsule(ProductFn fn, at::Tensor w, int64_t fmt, int64_t K,
                                         c10::optional<at::Tensor> bias) {
  return to_capsule<RowsOp>(std::make_unique<BoundProduct>(fn, std::move(w), fmt, K, std::move(bias)));
}

}  // namespace kvserve
