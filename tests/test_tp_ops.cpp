// Tensor and sequence parallelism's communication (dist/tp_ops.h) against the same computation
// on one rank: forward values and every gradient, at dp 2 x tp 2 (each dp group its own data,
// so a collective that strayed outside its tp group would show).
//
// Tolerances: everything runs in double. Splitting a layer over two ranks only reorders sums of
// at most 8 terms of magnitude ~10, so the results differ from the unsplit ones by a few units
// of 2^-53 relative (~1e-14 absolute); 1e-10 leaves ample room and still catches any missing,
// doubled or misplaced term, which would be O(0.1) or more.
#include <gtest/gtest.h>
#include <algorithm>

#include <map>

#include "dist/mesh.h"
#include "dist/tensor_parallel.h"
#include "dist/tp_ops.h"
#include "helpers.h"
#include "keel/common/error.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "keel/models/config.h"
#include "models/transformer.h"
#include "multirank.h"

using keel::dist::Axis;
using keel::dist::World;
namespace tp = keel::dist::tp;
using namespace keel::testing;

namespace {

constexpr double kTol = 1e-10;

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  EXPECT_LT(err, kTol) << what << ": max abs difference " << err;
}

struct Shapes {
  int64_t b = 2, t = 4, h = 6, f = 8, v = 10;
};

// A two-layer MLP, column- then row-parallel, with and without sequence parallelism.
void check_linear_regions(keel::dist::Collectives& group, int64_t r, int64_t n) {
  const Shapes s;
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  const auto x = torch::randn({s.b, s.t, s.h}, o), w1 = torch::randn({s.f, s.h}, o), w2 = torch::randn({s.h, s.f}, o);
  const auto probe = torch::randn({s.b, s.t, s.h}, o);  // d(loss)/d(output)
  auto xw = x.clone().requires_grad_(), w1w = w1.clone().requires_grad_(), w2w = w2.clone().requires_grad_();
  const auto yw = torch::linear(torch::gelu(torch::linear(xw, w1w)), w2w);
  (yw * probe).sum().backward();

  const int64_t fs = s.f / n, ts = s.t / n;
  {  // tensor parallel: the input whole on every rank, the output summed
    auto xs = x.clone().requires_grad_();
    auto w1s = w1.narrow(0, r * fs, fs).clone().requires_grad_(),
         w2s = w2.narrow(1, r * fs, fs).clone().requires_grad_();
    const auto ys = tp::reduce_from_region(
        torch::linear(torch::gelu(torch::linear(tp::copy_to_region(xs, group), w1s)), w2s), group);
    (ys * probe).sum().backward();
    expect_close(ys, yw, "tp output");
    expect_close(xs.grad(), xw.grad(), "tp input gradient");
    expect_close(w1s.grad(), w1w.grad().narrow(0, r * fs, fs), "column-parallel weight gradient");
    expect_close(w2s.grad(), w2w.grad().narrow(1, r * fs, fs), "row-parallel weight gradient");
  }
  {  // sequence parallel: input and output are this rank's positions of the sequence
    auto xq = x.narrow(1, r * ts, ts).clone().requires_grad_();
    auto w1q = w1.narrow(0, r * fs, fs).clone().requires_grad_(),
         w2q = w2.narrow(1, r * fs, fs).clone().requires_grad_();
    const auto yq = tp::scatter_sequence(
        torch::linear(torch::gelu(torch::linear(tp::gather_sequence(xq, 1, group), w1q)), w2q), 1, group);
    (yq * probe.narrow(1, r * ts, ts)).sum().backward();
    expect_close(yq, yw.narrow(1, r * ts, ts), "sp output shard");
    expect_close(xq.grad(), xw.grad().narrow(1, r * ts, ts), "sp input gradient shard");
    expect_close(w1q.grad(), w1w.grad().narrow(0, r * fs, fs), "sp column-parallel weight gradient");
    expect_close(w2q.grad(), w2w.grad().narrow(1, r * fs, fs), "sp row-parallel weight gradient");
  }
}

// The vocabulary split: the embedding's rows and the logits' columns.
void check_vocab_parallel(keel::dist::Collectives& group, int64_t r, int64_t n) {
  const Shapes s;
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  const auto range = tp::VocabRange::of(s.v, n, r);
  EXPECT_EQ(range.first, r * s.v / n);
  EXPECT_EQ(range.n, s.v / n);
  const auto ids = torch::randint(s.v, {s.b, s.t}, torch::kLong);
  const auto table = torch::randn({s.v, s.h}, o), probe = torch::randn({s.b, s.t, s.h}, o);
  auto tw = table.clone().requires_grad_();
  const auto ew = torch::embedding(tw, ids);
  (ew * probe).sum().backward();
  auto ts = table.narrow(0, range.first, range.n).clone().requires_grad_();
  const auto es = tp::vocab_parallel_embedding(ids, ts, range, group);
  (es * probe).sum().backward();
  expect_close(es, ew, "embedding");
  expect_close(ts.grad(), tw.grad().narrow(0, range.first, range.n), "embedding rows' gradient");
  {  // a padding id's row gets no gradient, whichever rank holds it; and the sequence-parallel output
    const int64_t pad = s.v - 1;
    auto tpad = table.clone().requires_grad_();
    (torch::embedding(tpad, ids, pad) * probe).sum().backward();
    auto tq = table.narrow(0, range.first, range.n).clone().requires_grad_();
    const auto eq = tp::vocab_parallel_embedding(ids, tq, range, group, /*sequence_parallel=*/true, pad);
    const int64_t ts = s.t / n;
    expect_close(eq, ew.narrow(1, r * ts, ts), "embedding to sequence shards");
    (eq * probe.narrow(1, r * ts, ts)).sum().backward();
    // (the reduce-scatter's backward gathers every position's gradient: the rows' gradient is whole)
    expect_close(tq.grad(), tpad.grad().narrow(0, range.first, range.n), "padded embedding rows' gradient");
  }

  const auto logits = torch::randn({s.b, s.t, s.v}, o) * 3, target = torch::randint(s.v, {s.b, s.t}, torch::kLong);
  auto lw = logits.clone().requires_grad_();
  const auto loss_w = torch::nn::functional::cross_entropy(lw.reshape({-1, s.v}), target.reshape({-1}));
  loss_w.backward();
  auto ls = logits.narrow(2, range.first, range.n).clone().requires_grad_();
  const auto loss_s = tp::vocab_parallel_cross_entropy(ls, target, range, group);
  loss_s.backward();
  expect_close(loss_s, loss_w, "cross-entropy");
  auto tied = logits.clone();
  tied.select(2, 0).copy_(tied.select(2, s.v - 1));  // a tie across the two ranks' columns: the first wins
  EXPECT_TRUE(torch::equal(tp::vocab_parallel_argmax(tied.narrow(2, range.first, range.n), range, group),
                           tied.reshape({-1, s.v}).argmax(1)));
  expect_close(ls.grad(), lw.grad().narrow(2, range.first, range.n), "logit columns' gradient");
  // Issue 64 item 5: targets equal to the ignore index (PyTorch's -100, and a class id taken as
  // one) count for nothing, as in PyTorch's cross_entropy(ignore_index) over the whole logits.
  for (const int64_t ignore : {int64_t{-100}, int64_t{3}}) {
    auto masked = target.clone();
    masked.reshape({-1}).index_put_({torch::arange(0, masked.numel(), 3)}, ignore);
    auto mw = logits.clone().requires_grad_();
    const auto want =
        torch::nn::functional::cross_entropy(mw.reshape({-1, s.v}), masked.reshape({-1}),
                                             torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore));
    want.backward();
    auto ms = logits.narrow(2, range.first, range.n).clone().requires_grad_();
    const auto got = tp::vocab_parallel_cross_entropy(ms, masked, range, group, ignore);
    got.backward();
    expect_close(got, want, "cross-entropy with ignored targets");
    expect_close(ms.grad(), mw.grad().narrow(2, range.first, range.n), "its gradient");
  }
  // Every target ignored: 0 and no gradient (PyTorch: NaN).
  auto none = logits.narrow(2, range.first, range.n).clone().requires_grad_();
  const auto zero = tp::vocab_parallel_cross_entropy(none, torch::full_like(target, -100), range, group);
  zero.backward();
  EXPECT_EQ(zero.item<double>(), 0.0);
  EXPECT_EQ(none.grad().abs().max().item<double>(), 0.0);
}

TEST(TensorParallel, RegionsAndVocabularySplitEqualOneRankForwardAndBackwardAtDp2Tp2) {
  auto ranks = run_ranks(4, [](const World& w) {
    keel::DistConfig cfg;
    cfg.validate = keel::Validate::Always;
    auto world = std::make_shared<keel::dist::Collectives>(keel::dist::Group::create(w, cfg, torch::kCPU),
                                                           keel::Validate::Always);
    auto mesh = keel::dist::Mesh::build(w, {1, 0, 2});
    mesh.connect(world, keel::Validate::Always);
    keel::dist::Collectives& group = mesh.on(Axis::Tp);
    // The ranks of one tp group draw the same data; the two dp groups different data.
    torch::manual_seed(static_cast<uint64_t>(100 + mesh.dp_rank()));
    check_linear_regions(group, mesh.coordinate(Axis::Tp), mesh.tp());
    check_vocab_parallel(group, mesh.coordinate(Axis::Tp), mesh.tp());
    world->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// Blocks shaped as each family's: gpt (Linear, fused q/k/v, GELU), gpt2 (Conv1D, fused, tanh
// GELU), llama (RMSNorm, separate q/k/v with grouped kv heads, SwiGLU, rotary, no biases).
std::vector<std::pair<std::string, keel::models::BlockOptions>> family_blocks() {
  using keel::models::BlockOptions;
  BlockOptions gpt;
  gpt.width = 16, gpt.heads = 4, gpt.kv_heads = 4, gpt.head_dim = 4, gpt.ffn = 32;
  BlockOptions gpt2 = gpt;
  gpt2.dense = BlockOptions::Dense::Conv1D, gpt2.mlp = BlockOptions::Mlp::GeluTanh;
  BlockOptions llama = gpt;
  llama.kv_heads = 2, llama.head_dim = 6, llama.ffn = 24;  // heads x head_dim != width
  llama.norm = BlockOptions::Norm::Rms, llama.mlp = BlockOptions::Mlp::SwiGlu, llama.fused_qkv = false;
  llama.rotary = true, llama.attention_bias = false, llama.mlp_bias = false;
  llama.names.norms_last = true;
  return {{"gpt", gpt}, {"gpt2", gpt2}, {"llama", llama}};
}

// One block sharded over the tp group against the whole block: output, input gradient, each
// parameter's gradient (a shard's against the same shard of the whole gradient). With sequence
// parallelism the input and output are this rank's positions, and a replicated parameter's
// gradient is this rank's part of the sum, so it is summed over the group first.
void check_block(keel::dist::Collectives& group, const keel::models::BlockOptions& o, bool sp,
                 const std::string& what) {
  const int64_t r = group.rank(), n = group.size(), B = 2, T = 4, ts = T / n;
  auto o64 = torch::TensorOptions().dtype(torch::kDouble);
  // Both blocks alike, every parameter drawn (GPT-2's Conv1D leaves its weight to the family).
  keel::models::TransformerBlock whole(o), sharded(o);
  for (auto* b : {&whole, &sharded}) {
    (*b)->to(torch::kDouble);
    torch::manual_seed(7);
    torch::NoGradGuard no_grad;
    for (auto& p : (*b)->parameters()) p.normal_(0, 0.3);
  }
  const auto plan = keel::models::tensor_parallel_plan(o, {});
  keel::dist::shard_block(*sharded, plan, group, sp);
  torch::Tensor cos, sin;
  if (o.rotary) {
    const auto angles = keel::models::rotary_angles(T, o.head_dim, 10000.0, torch::kCPU).to(torch::kDouble);
    cos = angles.cos(), sin = angles.sin();
  }
  const auto x = torch::randn({B, T, o.width}, o64), probe = torch::randn({B, T, o.width}, o64);
  auto xw = x.clone().requires_grad_();
  const auto yw = whole->forward(xw, cos, sin);
  (yw * probe).sum().backward();
  auto xs = (sp ? x.narrow(1, r * ts, ts) : x).clone().requires_grad_();
  const auto ys = sharded->forward(xs, cos, sin);
  (ys * (sp ? probe.narrow(1, r * ts, ts) : probe)).sum().backward();
  expect_close(ys, sp ? yw.narrow(1, r * ts, ts) : yw, what + ": output");
  expect_close(xs.grad(), sp ? xw.grad().narrow(1, r * ts, ts) : xw.grad(), what + ": input gradient");
  const auto whole_params = whole->named_parameters();
  int sharded_count = 0;
  for (const auto& p : sharded->named_parameters()) {
    const torch::Tensor& g_whole = whole_params[p.key()].grad();
    const keel::models::TpRule* rule = keel::models::tp_rule(plan, p.key());
    torch::Tensor g = p.value().grad().clone();
    if (rule) {
      ++sharded_count;
      expect_close(p.value(), keel::models::tp_slice(whole_params[p.key()], *rule, r, n), what + ": " + p.key());
    } else if (sp) {
      group.all_reduce(g, keel::dist::ReduceOp::Sum, "replicated gradient");
    }
    expect_close(g, rule ? keel::models::tp_slice(g_whole, *rule, r, n) : g_whole, what + ": " + p.key() + " gradient");
  }
  EXPECT_GE(sharded_count, 4) << what;
}

// A block whose heads, kv heads or MLP do not divide by tp is refused, naming the number.
void check_refusals(keel::dist::Collectives& group) {
  using keel::models::BlockOptions;
  for (const auto& [field, message] : std::vector<std::pair<int64_t BlockOptions::*, std::string>>{
           {&BlockOptions::heads, "model.heads = 3 does not divide by tp = 2"},
           {&BlockOptions::kv_heads, "model.kv_heads = 3 does not divide by tp = 2"},
           {&BlockOptions::ffn, "the MLP's width = 3 does not divide by tp = 2"}}) {
    auto bad = family_blocks()[2].second;
    bad.*field = 3;
    if (field == &BlockOptions::heads) bad.kv_heads = 3;
    keel::models::TransformerBlock block(bad);
    try {
      keel::dist::shard_block(*block, keel::models::tensor_parallel_plan(bad, {}), group, false);
      ADD_FAILURE() << message;
    } catch (const keel::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

TEST(TensorParallel, EachFamilysBlockOverTp2EqualsTheWholeBlockWithAndWithoutSequenceParallelism) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto world = std::make_shared<keel::dist::Collectives>(
        keel::dist::Group::create(w, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
    for (const auto& [family, o] : family_blocks())
      for (bool sp : {false, true}) check_block(*world, o, sp, family + (sp ? " (sp)" : " (tp)"));
    check_refusals(*world);
    world->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// A whole model of a family over the tp group against the whole model on one rank: the logits
// are this rank's vocabulary columns, the loss over them equals the loss over the whole
// vocabulary, and every parameter's gradient is the same slice of the whole model's (a tied
// embedding's rows get the lookups' and the output projection's parts alike). With sequence
// parallelism the replicated parameters' gradients are complete once the shard's partial
// gradients are finished (summed over tp), as the step does after its backward.
void check_family_model(keel::dist::Collectives& group, const keel::ModelConfig& c, bool sp, int sharded_want) {
  const int64_t r = group.rank(), n = group.size();
  const std::string what = c.name + (c.tie_embeddings ? "" : " (untied)") + (sp ? " (sp)" : " (tp)");
  auto build = [&] {
    torch::manual_seed(11);
    auto m = keel::models::create_model(c);
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : m->named_parameters()) t.set_data(t.to(torch::kDouble));
    return m;
  };
  auto whole = build(), sharded = build();
  const auto shard = keel::dist::shard_model_tensor_parallel(*sharded, group, sp);
  const std::vector<bool> partial = shard.partial();
  EXPECT_EQ(std::count(partial.begin(), partial.end(), true) > 0, sp) << what;
  const int64_t vocab = whole->input_spec().num_classes;
  const auto ids = torch::randint(vocab, {2, c.context}, torch::kLong);
  const auto target = torch::randint(vocab, {2, c.context}, torch::kLong);
  const auto lw = whole->forward(ids);
  const auto loss_w = torch::nn::functional::cross_entropy(lw.reshape({-1, vocab}), target.reshape({-1}));
  loss_w.backward();
  const auto range = tp::VocabRange::of(vocab, n, r);
  EXPECT_EQ(shard.range.first, range.first);
  const auto ls = sharded->forward(ids);
  expect_close(ls, lw.narrow(2, range.first, range.n), what + " logits");
  const auto loss_s = tp::vocab_parallel_cross_entropy(ls, target, range, group);
  loss_s.backward();
  std::vector<torch::Tensor> summed;  // as DataParallel::backward does on a step's last micro-batch
  const auto params = sharded->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (partial[i]) summed.push_back(params[i]);
  tp::sum_gradients(summed, group);
  expect_close(loss_s, loss_w, what + " loss");
  std::map<std::string, torch::Tensor> whole_params;
  for (const auto& [name, t] : whole->named_parameters()) whole_params[name] = t;
  const auto& plan = keel::models::transformer_family(c.name)->tp_plan;
  int sharded_count = 0;
  for (const auto& [name, t] : sharded->named_parameters()) {
    const keel::models::TpRule* rule = keel::models::tp_rule(plan, name);
    const torch::Tensor& w = whole_params.at(name);
    sharded_count += rule ? 1 : 0;
    expect_close(t, rule ? keel::models::tp_slice(w, *rule, r, n) : w, what + " " + name);
    expect_close(t.grad(), rule ? keel::models::tp_slice(w.grad(), *rule, r, n) : w.grad(),
                 what + " " + name + " gradient");
  }
  EXPECT_EQ(sharded_count, sharded_want) << what;
}

keel::ModelConfig small(const std::string& name) {
  keel::ModelConfig c;
  c.name = name, c.vocab = 32, c.width = 16, c.heads = 4, c.depth = 2, c.context = 8, c.dropout = 0;
  return c;
}

void check_gpt_model(keel::dist::Collectives& group) {
  for (bool sp : {false, true}) check_family_model(group, small("gpt"), sp, 1 + 2 * 6);  // wte, 6 per block
  // Refused by name: a model without a plan, a vocabulary that does not divide.
  auto refused = [&](keel::ModelConfig bad) -> std::string {
    try {
      keel::dist::shard_model_tensor_parallel(*keel::models::create_model(bad), group);
    } catch (const keel::InputError& e) {
      return e.what();
    }
    return "";
  };
  keel::ModelConfig mlp;
  mlp.name = "mlp";
  EXPECT_NE(refused(mlp).find("model.name = \"mlp\" has no tensor-parallel plan"), std::string::npos);
  keel::ModelConfig odd = small("gpt");
  odd.vocab = 31;
  EXPECT_NE(refused(odd).find("model.vocab = 31 does not divide by tp = 2"), std::string::npos);
  keel::ModelConfig gqa = small("llama");
  gqa.kv_heads = 1;
  EXPECT_NE(refused(gqa).find("model.kv_heads = 1 does not divide by tp = 2"), std::string::npos);
}

TEST(TensorParallel, AGptShardedOverTp2GivesTheWholeModelsLogitsLossAndGradients) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto world = std::make_shared<keel::dist::Collectives>(
        keel::dist::Group::create(w, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
    check_gpt_model(*world);
    world->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// gpt2 (GPT-2's Conv1D layout, a fused c_attn split by q, k and v heads) and llama (separate
// q, k, v with grouped-query attention: 4 query heads over 2 key/value heads, one of each per
// rank; SwiGLU; RMSNorm; rotary positions over the gathered sequence), tied and untied, each
// with and without sequence parallelism.
TEST(TensorParallel, Gpt2AndLlamaWithGqaShardedOverTp2GiveTheWholeModelsLogitsLossAndGradients) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto world = std::make_shared<keel::dist::Collectives>(
        keel::dist::Group::create(w, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
    for (bool tied : {true, false})
      for (bool sp : {false, true}) {
        keel::ModelConfig gpt2 = small("gpt2");
        gpt2.tie_embeddings = tied;
        check_family_model(*world, gpt2, sp, (tied ? 1 : 2) + 2 * 6);  // wte (lm_head), 6 per block
        keel::ModelConfig llama = small("llama");
        llama.kv_heads = 2, llama.ffn_width = 24, llama.tie_embeddings = tied;
        check_family_model(*world, llama, sp, (tied ? 1 : 2) + 2 * 7);  // q, k, v, o, gate, up, down weights
      }
    world->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// Dropout under tp: the masks agree where every tp rank holds a tensor whole (the embeddings'
// and residual dropout without sequence parallelism) and are each rank's own where it holds a
// part (its heads' attention weights; with sequence parallelism its positions). A mask that
// differed where the layout shares a tensor would give the ranks different replicated
// activations, and so their replicated parameters (norms, biases, a position embedding)
// different gradients: those are compared across the group, bit for bit.
void check_dropout_agrees(keel::dist::Collectives& group, keel::ModelConfig c, bool sp) {
  c.dropout = 0.3;
  const std::string what = c.name + (sp ? " (sp)" : " (tp)") + " with dropout";
  torch::manual_seed(11);
  auto m = keel::models::create_model(c);
  const auto shard = keel::dist::shard_model_tensor_parallel(*m, group, sp);
  m->train(true);
  const int64_t vocab = m->input_spec().num_classes;
  const auto ids = torch::randint(vocab, {2, c.context}, torch::kLong);
  const auto target = torch::randint(vocab, {2, c.context}, torch::kLong);
  const auto loss = tp::vocab_parallel_cross_entropy(m->forward(ids), target, shard.range, group);
  loss.backward();
  const std::vector<bool> partial = shard.partial(), replicated = shard.replicated();
  const auto named = m->named_parameters();
  std::vector<torch::Tensor> summed;
  for (size_t i = 0; i < named.size(); ++i)
    if (partial[i]) summed.push_back(named[i].second);
  tp::sum_gradients(summed, group);
  int compared = 0;
  for (size_t i = 0; i < named.size(); ++i) {
    if (!replicated[i]) continue;
    const auto parts = group.all_gather(named[i].second.grad().contiguous(), "replicated gradient");
    EXPECT_TRUE(torch::equal(parts[0], parts[1])) << what << ": " << named[i].first;
    ++compared;
  }
  EXPECT_GT(compared, 0) << what;
  // (and the dropout did drop: the evaluation's loss, without it, is another)
  m->train(false);
  torch::NoGradGuard no_grad;
  EXPECT_NE(tp::vocab_parallel_cross_entropy(m->forward(ids), target, shard.range, group).item<double>(),
            loss.item<double>())
      << what;
}

TEST(TensorParallel, DropoutMasksAgreeWhereTheTpRanksShareATensor) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto world = std::make_shared<keel::dist::Collectives>(
        keel::dist::Group::create(w, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
    for (bool sp : {false, true}) {
      check_dropout_agrees(*world, small("gpt"), sp);
      check_dropout_agrees(*world, small("gpt2"), sp);
      keel::ModelConfig llama = small("llama");
      llama.kv_heads = 2, llama.ffn_width = 24;
      check_dropout_agrees(*world, llama, sp);
    }
    world->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// A rank's own masks: another rank's differ, the same rank's repeat from the same generator
// state, and the generators' shared stream is where it would be had any rank drawn them.
TEST(TensorParallel, OwnMasksDifferByRankRepeatFromTheGeneratorsAndKeepTheSharedStreamInStep) {
  const auto x = torch::ones({4096});
  auto own = [&](int64_t rank) {
    torch::manual_seed(5);
    const auto mask = keel::models::drop_own(x, 0.5, true, rank).ne(0);
    return std::pair{mask, torch::rand({8})};
  };
  const auto [m0, after0] = own(0);
  const auto [m1, after1] = own(1);
  const auto [m0_again, after0_again] = own(0);
  EXPECT_FALSE(torch::equal(m0, m1));
  EXPECT_TRUE(torch::equal(m0, m0_again));
  EXPECT_TRUE(torch::equal(after0, after1));
  EXPECT_TRUE(torch::equal(after0, after0_again));
  const double kept = m0.to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(kept, 0.5, 0.05);  // 4096 draws: 6.4 standard deviations
  // Evaluating, or p = 0: nothing drawn at all.
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(keel::models::drop_own(x, 0.5, false, 1), x));
  EXPECT_TRUE(torch::equal(keel::models::drop_own(x, 0.0, true, 1), x));
  const auto next = torch::rand({8});
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(next, torch::rand({8})));
}

// A tensor-parallel run: its ranks, per-rank batch, tp, sequence parallelism and dist.zero.
struct Mesh2d {
  std::string run;
  int ranks = 2;
  int64_t batch = 8, tp = 2;
  bool sp = false;
  int zero = 0;
};
const std::vector<Mesh2d> kTpMeshes = {{"tp2"}, {"tp2_sp", 2, 8, 2, true}, {"dp2tp2_sp", 4, 4, 2, true}};

// parallel.tp = 2 trains each family as one rank does with the same global batch: at (dp 1, tp 2)
// the two ranks read the one rank's batch, at (dp 2, tp 2) each dp pair half of it; with and
// without sequence parallelism. The per-step losses and the final evaluation agree within issue
// 45's 1e-5 relative: tensor parallelism only reorders float32 sums (a row-parallel product's
// two halves, the cross-entropy's sum of exponentials, sequence parallelism's gradient parts),
// each off by a few units of 2^-24, which AdamW does not amplify over 20 steps beyond that (an
// update is invariant to a common scale of the gradients).
// Returns the one-rank run's skipped_steps (summary.json), which every mesh's run matches.
std::string expect_trains_as_one_rank(const std::vector<std::string>& model, const std::string& label,
                                      const std::vector<Mesh2d>& meshes = kTpMeshes) {
  TempDir d;
  auto args = [&](const std::string& run, int64_t batch, int64_t tp, bool sp, int zero) {
    std::vector<std::string> a = {"train",
                                  "--data.name=synthetic",
                                  "--train.steps=20",
                                  "--train.batch_size=" + std::to_string(batch),
                                  "--train.eval_interval=20",
                                  "--parallel.tp=" + std::to_string(tp),
                                  std::string("--parallel.sequence_parallel=") + (sp ? "true" : "false"),
                                  "--dist.zero=" + std::to_string(zero),
                                  "--run.threads=1",
                                  "--run.dir=" + d.file(run)};
    a.insert(a.begin() + 1, model.begin(), model.end());
    return a;
  };
  const auto one = run_keel(args("one", 8, 1, false, 0));
  EXPECT_EQ(one.exit_code, 0) << label << ": " << one.output;
  if (one.exit_code != 0) return "";
  for (const Mesh2d& m : meshes) expect_all_ok(run_keel_ranks(m.ranks, args(m.run, m.batch, m.tp, m.sp, m.zero)));
  const auto base = metrics_losses(d.file("one"));
  EXPECT_EQ(base.size(), 20u) << label;
  if (base.size() != 20u) return "";
  // With train.grad_clip, each step's norm over the mesh too (AdamW's update hardly depends on
  // a common scale of the gradients, so the losses alone would not show a wrong norm).
  const auto base_norms = metrics_losses(d.file("one"), "grad_norm");
  for (const Mesh2d& m : meshes) {
    const std::string& run = m.run;
    for (const auto& [field, want] : {std::pair{"loss", base}, std::pair{"grad_norm", base_norms}}) {
      const auto got = metrics_losses(d.file(run), field);
      EXPECT_EQ(got.size(), want.size()) << label << " " << run << " " << field;
      for (size_t i = 0; i < std::min(want.size(), got.size()); ++i)
        EXPECT_NEAR(got[i].second, want[i].second, 1e-5 * std::abs(want[i].second))
            << label << " " << run << " " << field << " at step " << got[i].first;
    }
    for (const char* key : {"test_loss", "final_loss"}) {
      const double want = std::stod(summary_field(d.file("one"), key)),
                   have = std::stod(summary_field(d.file(run), key));
      EXPECT_NEAR(have, want, 1e-5 * std::abs(want)) << label << " " << run << " " << key;
    }
    EXPECT_EQ(summary_field(d.file(run), "test_accuracy"), summary_field(d.file("one"), "test_accuracy"))
        << label << " " << run;
    // The GradScaler's verdict and scale (amp.loss_scaling): one over the whole mesh, as one rank's.
    for (const char* key : {"skipped_steps", "loss_scale"})
      EXPECT_EQ(summary_field(d.file(run), key), summary_field(d.file("one"), key))
          << label << " " << run << " " << key;
  }
  return summary_field(d.file("one"), "skipped_steps");
}

const std::vector<std::string> kSmall = {"--model.width=32", "--model.depth=2", "--model.heads=4",
                                         "--model.context=16"};

std::vector<std::string> small_model(const std::string& name, std::vector<std::string> extra) {
  std::vector<std::string> a = {"--model.name=" + name};
  a.insert(a.end(), kSmall.begin(), kSmall.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

TEST(TensorParallel, AGptTrainsAtTp2AndAtDp2Tp2AsOneRankDoes) {
  expect_trains_as_one_rank(small_model("gpt", {}), "gpt");
}

TEST(TensorParallel, Gpt2AndLlamaWithGqaTrainAtTp2AndAtDp2Tp2AsOneRankDoes) {
  expect_trains_as_one_rank(small_model("gpt2", {"--model.dropout=0", "--model.tie_embeddings=false"}), "gpt2");
  // llama with clipping by the global norm over the mesh (0.05: below the steps' norms here, so
  // the steps are clipped, and a norm that missed or doubled a part would scale them otherwise).
  expect_trains_as_one_rank(
      small_model("llama", {"--model.kv_heads=2", "--model.ffn_width=64", "--train.grad_clip=0.05"}), "llama");
}

// Item 4's composition: gradient accumulation, the fused optimizer and the GradScaler at tp 2.
// amp.loss_scaling = dynamic runs the scaler on the CPU too: every step's gradients unscaled and
// checked over the whole mesh, and, with growth_interval 2, the scale doubling every other step
// (65536 to 2^26 over 20 steps), which every mesh must follow as one rank does (summary.json's
// loss_scale). (A skipped step is not forced here: an overflow near float32's limit depends on
// how the batch is split, since a dp rank's half batch doubles its per-sample gradients before
// they are averaged, so one rank and a mesh would rightly skip different steps; fault.inject's
// nonfinite_grad makes the skip instead.)
TEST(TensorParallel, GradAccumFusedOptimizerAndTheGradScalerAtTp2TrainAsOneRankDoes) {
  const std::string skipped =
      expect_trains_as_one_rank(small_model("gpt", {"--train.grad_accum=2", "--train.fused_optimizer=true",
                                                    "--amp.loss_scaling=dynamic", "--amp.growth_interval=2"}),
                                "gpt, grad_accum 2, fused AdamW, GradScaler");
  EXPECT_EQ(skipped, "0");
  // One verdict over the whole mesh: a non-finite gradient on rank 0 alone (fault.inject) at step
  // 5 makes every rank of every mesh skip that step and back the scale off, as one rank does; a
  // verdict agreed over the dp axis only would let rank 0's tp peers step, and the losses part.
  EXPECT_EQ(expect_trains_as_one_rank(
                small_model("gpt", {"--train.fused_optimizer=true", "--amp.loss_scaling=dynamic",
                                    "--amp.growth_interval=2", "--fault.inject=nonfinite_grad@step=5,rank=0"}),
                "gpt, GradScaler, a non-finite gradient on rank 0"),
            "1");
}

// Every refusal of the mesh and of what tensor parallelism does not serve yet, exit 2 naming the key.
// Item 4: ZeRO over the dp axis shards the tp shards. Stage 1 steps whole tp slices on their dp
// owner, stages 2 and 3 pieces of them (3: gathered around each block); sequence parallelism's
// partial gradients are summed on those pieces and the norm (train.grad_clip, below every step's
// norm so that every step is clipped) counts each part once over dp and tp.
TEST(TensorParallel, ZeroOneToThreeOverDp2OfTp2TrainAsOneRankDoes) {
  const std::vector<Mesh2d> zero = {{"dp2tp2_zero1_sp", 4, 4, 2, true, 1},
                                    {"dp2tp2_zero2", 4, 4, 2, false, 2},
                                    {"dp2tp2_zero3_sp", 4, 4, 2, true, 3}};
  expect_trains_as_one_rank(small_model("gpt", {"--train.grad_clip=0.05"}), "gpt", zero);
  expect_trains_as_one_rank(
      small_model("llama", {"--model.kv_heads=2", "--model.ffn_width=64", "--train.grad_clip=0.05"}), "llama",
      {{"dp2tp2_zero2_sp", 4, 4, 2, true, 2}, zero[2]});
}

// Issue 64 item 1: every placement trains as one rank does, over dist.zero 0-3 x dp 1, 2 x tp 1,
// 2 (eager here; compiled with blocks in InductorBlocks.EveryZeroStageCompiled*). The global batch is
// one rank's 8 everywhere (dp 2: 4 per rank). train.grad_clip = 0.05, below every step's norm, so
// that each step's grad_norm (over the whole mesh) is compared too; losses and norms within issue
// 45's 1e-5 relative (the reorderings of float32 sums, expect_trains_as_one_rank). At dp 1 ZeRO
// has nothing to shard: stages 2 and 3 once trained nothing there (every step's loss the lr = 0
// run's, grad_norm 0, exit 0), which these runs would show at their first step.
std::vector<Mesh2d> zero_stages(const std::string& at, int ranks, int64_t batch, int64_t tp, int from = 0) {
  std::vector<Mesh2d> out;
  for (int zero = from; zero <= 3; ++zero)
    out.push_back({at + "_zero" + std::to_string(zero), ranks, batch, tp, false, zero});
  return out;
}
const std::vector<std::string> kPlacementModel = small_model("gpt", {"--train.grad_clip=0.05"});

TEST(Placements, EveryZeroStageAtDp1TrainsAsOneRankDoesAtTp1AndTp2) {
  auto meshes = zero_stages("dp1tp1", 1, 8, 1, /*from=*/1);
  for (const auto& m : zero_stages("dp1tp2", 2, 8, 2)) meshes.push_back(m);
  expect_trains_as_one_rank(kPlacementModel, "gpt at dp 1", meshes);
}

TEST(Placements, EveryZeroStageAtDp2TrainsAsOneRankDoes) {
  expect_trains_as_one_rank(kPlacementModel, "gpt at dp 2", zero_stages("dp2tp1", 2, 4, 1));
}

TEST(Placements, EveryZeroStageAtDp2Tp2TrainsAsOneRankDoes) {
  expect_trains_as_one_rank(kPlacementModel, "gpt at dp 2 x tp 2", zero_stages("dp2tp2", 4, 4, 2));
}

TEST(TensorParallel, BadMeshesAndWhatTpDoesNotServeYetAreRefusedByName) {
  const std::vector<std::string> base = {"train",           "--model.name=gpt",   "--model.width=32",
                                         "--model.depth=1", "--model.context=16", "--data.name=synthetic",
                                         "--train.steps=2", "--parallel.tp=2"};
  for (const auto& [extra, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--model.heads=3"}, "parallel.tp = 2 splits model.heads = 3 over tp ranks: it does not divide by 2"},
           {{"--model.vocab=255"}, "parallel.tp = 2 splits model.vocab = 255"},
           {{"--model.name=mlp"}, "model.name = \"mlp\" has none"},
           {{"--model.name=llama", "--model.kv_heads=1"},
            "parallel.tp = 2 splits model.kv_heads = 1 over tp ranks: it does not divide by 2"},
           {{"--parallel.sequence_parallel=true", "--model.context=15"},
            "with parallel.sequence_parallel = true splits model.context = 15 positions"},
           {{"--compile.mode=trace"}, "cannot be combined with compile.mode = \"trace\" yet"},
           {{"--compile.mode=inductor", "--compile.granularity=step"},
            "has collectives inside each block, which compile.granularity = \"step\""},
           {{"--fault.inject=graph_break@step=1,rank=1"}, "cannot be combined with fault.inject"}}) {
    auto a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    const auto r = run_keel(a);
    EXPECT_EQ(r.exit_code, 2) << extra[0] << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << extra[0] << ": " << r.output;
  }
  // The mesh against the world: tp 2 on 3 ranks; dp 2 x tp 2 on 2.
  TempDir d;
  auto a = base;
  a.push_back("--run.dir=" + d.file("run"));
  for (const auto& r : run_keel_ranks(3, a)) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("parallel.tp = 2 must divide the world size 3"), std::string::npos) << r.output;
  }
  a.push_back("--parallel.dp=2");
  for (const auto& r : run_keel_ranks(2, a)) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("parallel.dp = 2 x parallel.tp = 2 is 4 ranks; the world has 2"), std::string::npos)
        << r.output;
  }
}

// One rank: each region is the identity and the vocabulary range is the whole vocabulary.
TEST(TensorParallel, OneRankRegionsAreTheIdentity) {
  auto coll = std::make_shared<keel::dist::Collectives>(
      keel::dist::Group::create(World{}, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
  torch::manual_seed(3);
  check_linear_regions(*coll, 0, 1);
  check_vocab_parallel(*coll, 0, 1);
  EXPECT_THROW(tp::VocabRange::of(10, 3, 0), std::invalid_argument);
}

}  // namespace
