// The fixed init pipeline place -> compile -> distribute, enforced by types.
#include <gtest/gtest.h>

#include <type_traits>

#include "trainer/compile/pipeline.h"

using keel::CompiledModel;
using keel::DistributedModel;
using keel::PlacedModel;

namespace {

template <class T, class = void>
struct can_compile : std::false_type {};
template <class T>
struct can_compile<T, std::void_t<decltype(std::declval<T>().compile(std::declval<const keel::CompileConfig&>(),
                                                                     std::declval<const torch::Tensor&>()))>>
    : std::true_type {};

template <class T, class = void>
struct can_distribute : std::false_type {};
template <class T>
struct can_distribute<
    T, std::void_t<decltype(std::declval<T>().distribute(std::declval<std::shared_ptr<keel::dist::Collectives>>(),
                                                         std::declval<const keel::DistConfig&>()))>> : std::true_type {
};

// The order is the only one that type-checks.
static_assert(can_compile<PlacedModel&&>::value, "a placed model can be compiled");
static_assert(can_distribute<CompiledModel&&>::value, "a compiled model can be distributed");
// DDP before placement or before compile, compile after DDP, compile twice: do not compile.
static_assert(!can_distribute<PlacedModel&&>::value, "DDP needs a compiled model");
static_assert(!can_compile<CompiledModel&&>::value, "no second compile");
static_assert(!can_compile<DistributedModel&&>::value, "compile after DDP is refused");
static_assert(!can_distribute<DistributedModel&&>::value, "no second DDP wrap");
// Each step consumes its stage: a named (lvalue) stage must be std::move'd, so it cannot be
// used again by accident.
static_assert(!can_compile<PlacedModel&>::value, "compile consumes the placed model");
static_assert(!can_distribute<CompiledModel&>::value, "distribute consumes the compiled model");
// Stages are made only by the previous step: no public constructors, no copies.
static_assert(!std::is_default_constructible_v<PlacedModel>);
static_assert(!std::is_default_constructible_v<CompiledModel>);
static_assert(!std::is_default_constructible_v<DistributedModel>);
static_assert(!std::is_copy_constructible_v<PlacedModel>);
static_assert(!std::is_copy_constructible_v<CompiledModel>);
static_assert(!std::is_copy_constructible_v<DistributedModel>);
static_assert(!std::is_constructible_v<CompiledModel, std::shared_ptr<keel::models::Model>>);
static_assert(!std::is_constructible_v<DistributedModel, std::shared_ptr<keel::models::Model>>);

TEST(Pipeline, TypesEnforceTheOrder) {
  // The static_asserts above are the test; this records that they were compiled.
  SUCCEED();
}

TEST(Pipeline, RunsEndToEndOnOneProcess) {
  keel::ModelConfig mc;
  mc.name = "mlp";
  auto coll = std::make_shared<keel::dist::Collectives>(
      keel::dist::Group::create(keel::dist::World{}, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
  DistributedModel dm = keel::place(keel::models::create_model(mc), torch::kCPU)
                            .compile(keel::CompileConfig{}, torch::randn({4, 1, 28, 28}))
                            .distribute(coll, keel::DistConfig{});
  auto loss = dm.forward(torch::randn({4, 1, 28, 28}), true).sum();
  dm.backward(loss, true);
  for (auto& p : dm.model().parameters()) EXPECT_TRUE(p.grad().defined());
}

// A model that ignores to(): its tensors stay where they are.
class StuckModel : public keel::models::Model {
 public:
  std::string name() const override { return "stuck"; }
  keel::models::InputSpec input_spec() const override { return {}; }
  torch::Tensor forward(const torch::Tensor& x) override { return x; }
  keel::models::NamedTensors named_parameters() const override { return {{"w", w_}}; }
  keel::models::NamedTensors named_buffers() const override { return {}; }
  void to(const torch::Device&) override {}
  void train(bool) override {}

 private:
  torch::Tensor w_ = torch::zeros({2});
};

TEST(Pipeline, PlaceNamesATensorLeftOnAnotherDevice) {
  try {
    keel::place(std::make_shared<StuckModel>(), torch::Device(torch::kMeta));
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parameter 'w'"), std::string::npos) << m;
    EXPECT_NE(m.find("is on cpu, not on meta"), std::string::npos) << m;
  }
}

}  // namespace
