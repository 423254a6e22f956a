// tests/custom_ops/keel_test_ops.cpp: custom ops in a shared library (compile.libraries), for the
// inductor tests: keel_test::affine has a schema, a CPU kernel and a fake (Meta) kernel, so it
// compiles into an AOTInductor package, which calls it through the dispatcher; keel_test::no_fake
// has no fake kernel, so the packaging step must refuse it naming the op and the fix.
#include <torch/library.h>
#include <torch/torch.h>

namespace {

torch::Tensor affine(const torch::Tensor& x, double scale, double shift) { return x * scale + shift; }

torch::Tensor affine_meta(const torch::Tensor& x, double, double) { return torch::empty_like(x); }

torch::Tensor no_fake(const torch::Tensor& x) { return x.clone(); }

}  // namespace

TORCH_LIBRARY(keel_test, m) {
  m.def("affine(Tensor x, float scale, float shift) -> Tensor");
  m.def("no_fake(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(keel_test, CPU, m) {
  m.impl("affine", affine);
  m.impl("no_fake", no_fake);
}

TORCH_LIBRARY_IMPL(keel_test, Meta, m) { m.impl("affine", affine_meta); }
