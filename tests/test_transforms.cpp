// The fixed init pipeline place -> compile -> distribute, enforced by types.
#include <gtest/gtest.h>

#include <type_traits>

#include "dist/mesh.h"
#include "dist/stages.h"
#include "dist/transform_plan.h"
#include "trainer/compile/transforms.h"

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

TEST(Transforms, TypesEnforceTheOrder) {
  // The static_asserts above are the test; this records that they were compiled.
  SUCCEED();
}

TEST(Transforms, RunsEndToEndOnOneProcess) {
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

// place -> compile -> distribute are the five transforms in their one order, each recording what
// it did to the model.
TEST(Transforms, TheTransformsRunInTheirOneOrderAndSayWhatEachDid) {
  keel::ModelConfig mc;
  mc.name = "mlp";
  auto coll = std::make_shared<keel::dist::Collectives>(
      keel::dist::Group::create(keel::dist::World{}, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
  keel::DistConfig dc;
  dc.zero = 1;
  keel::CompileConfig cc;
  cc.mode = keel::CompileMode::Trace;
  DistributedModel dm = keel::place(keel::models::create_model(mc), torch::kCPU)
                            .compile(cc, torch::randn({4, 1, 28, 28}))
                            .distribute(coll, dc);
  const auto& steps = dm.transforms().steps();
  ASSERT_TRUE(dm.transforms().complete());
  ASSERT_EQ(steps.size(), keel::dist::kTransformOrder.size());
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i].first, keel::dist::kTransformOrder[i]) << i;
  EXPECT_EQ(dm.transforms().describe(),
            "stages: whole model (pp 1) -> tensor parallel: none (tp 1) -> recompute: off -> compile: trace -> "
            "data parallel: zero 1 over 1 rank");
}

// The record refuses a transform out of its place: a second line behind the types.
TEST(Transforms, ATransformOutOfOrderIsRefusedNamingBoth) {
  using keel::dist::Transform;
  auto refused = [](keel::dist::TransformPlan& p, Transform t) -> std::string {
    try {
      p.applied(t, "x");
    } catch (const std::logic_error& e) {
      return e.what();
    }
    return "";
  };
  keel::dist::TransformPlan plan;
  EXPECT_NE(refused(plan, Transform::Compile).find("compile applied where stages comes next"), std::string::npos);
  plan.applied(Transform::Stages, "whole model");
  EXPECT_NE(refused(plan, Transform::Stages).find("stages applied where tensor parallel comes next"),
            std::string::npos);
  EXPECT_NE(refused(plan, Transform::DataParallel).find("data parallel applied where tensor parallel comes next"),
            std::string::npos);
  for (Transform t : {Transform::TensorParallel, Transform::Recompute, Transform::Compile, Transform::DataParallel})
    plan.applied(t, "x");
  EXPECT_TRUE(plan.complete());
  EXPECT_NE(refused(plan, Transform::DataParallel).find("after the last transform"), std::string::npos);
}

// A mesh whose pp axis is larger than 1 reaches a transform that is not there yet: placing on it
// fails naming the axis, instead of training the whole model on every rank unnoticed. (tp > 1
// shards the model: tests/test_tp_ops.cpp.)
// The pipeline split (dist/stages.h): each pp rank's StageModel holds its stages' blocks and the
// root's parameters (at both ends), runs one stage at a time, and the stages in turn compute the
// whole model's logits exactly; "even" balances the blocks' parameters; a pp without the
// schedule's stages is a logic error, more stages than blocks the user's (exit 2).
TEST(Transforms, PipelineStagesHoldTheirBlocksAndTheRootAndComposeToTheWholeModel) {
  keel::ModelConfig mc;
  mc.name = "gpt";
  mc.width = 32;
  mc.depth = 4;
  mc.heads = 4;
  mc.context = 16;
  auto whole = keel::models::create_model(mc);
  keel::dist::World world;
  world.size = 2;
  std::vector<std::shared_ptr<keel::dist::StageModel>> ranks;
  for (int64_t r : {0, 1}) {
    world.rank = r;
    keel::dist::TransformPlan plan;
    auto m = keel::dist::split_into_stages(whole, keel::dist::Mesh::build(world, {2, 0, 1}), {{0, 1}, {}}, plan);
    ranks.push_back(std::dynamic_pointer_cast<keel::dist::StageModel>(m));
    ASSERT_TRUE(ranks.back()) << "pp 2 made no StageModel";
  }
  auto holds = [](const keel::dist::StageModel& m, const std::string& prefix) {
    for (const auto& [n, t] : m.named_parameters())
      if (n.compare(0, prefix.size(), prefix) == 0) return true;
    return false;
  };
  for (const char* root : {"wte.", "wpe.", "ln_f."}) EXPECT_TRUE(holds(*ranks[0], root) && holds(*ranks[1], root));
  EXPECT_TRUE(holds(*ranks[0], "h.1.") && !holds(*ranks[0], "h.2."));
  EXPECT_TRUE(holds(*ranks[1], "h.3.") && !holds(*ranks[1], "h.0."));
  EXPECT_EQ(ranks[0]->describe(), "blocks 0-1 | blocks 2-3");
  torch::NoGradGuard no_grad;
  whole->train(false);
  const auto tokens = torch::randint(0, 256, {2, 16});
  const auto logits = whole->forward(tokens);
  const auto staged = ranks[1]->forward_stage(1, ranks[0]->forward_stage(0, tokens));
  EXPECT_TRUE(torch::equal(staged, logits));
  EXPECT_TRUE(torch::equal(whole->forward(tokens), logits)) << "a stage's forward left the model split";
  // "even": the largest stage's parameters as small as they can be, the root's half on either end.
  auto firsts = [](const std::vector<keel::models::BlockStructure::Stage>& s) {
    std::vector<size_t> f;
    for (const auto& r : s) f.push_back(r.first);
    return f;
  };
  EXPECT_EQ(firsts(keel::dist::split_blocks({1, 1, 1, 5}, 0, 2, {})), (std::vector<size_t>{0, 3}));
  EXPECT_EQ(firsts(keel::dist::split_blocks({4, 4, 4, 4}, 8, 2, {})), (std::vector<size_t>{0, 2}));
  EXPECT_EQ(firsts(keel::dist::split_blocks({4, 4, 4, 4}, 0, 2, {3})), (std::vector<size_t>{0, 3}));
  EXPECT_THROW(keel::dist::split_blocks({4, 4}, 0, 3, {}), keel::InputError);
  keel::dist::TransformPlan plan;
  EXPECT_THROW(keel::dist::split_into_stages(whole, keel::dist::Mesh::build(world, {2, 0, 1}), {}, plan),
               std::logic_error);
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

TEST(Transforms, PlaceNamesATensorLeftOnAnotherDevice) {
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
