// Models: output shapes, parameter counts, registry, and golden checks of the cnn and gpt
// against PyTorch (tests/golden/make_golden.py) from identical weights and inputs.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include <nlohmann/json.hpp>
#include <set>

#include "helpers.h"
#include "keel/models/model.h"
#include "models/hf.h"
#include "models/transformer.h"

using keel::models::create_model;

namespace {

keel::ModelConfig model_cfg(const std::string& name) {
  keel::ModelConfig c;
  c.name = name;
  return c;
}

TEST(Models, OutputShapesAndParameterCounts) {
  auto mlp = create_model(model_cfg("mlp"));
  EXPECT_EQ(mlp->forward(torch::randn({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));
  // 784*256+256 + 7*(256*256+256) + 256*10+10
  EXPECT_EQ(mlp->num_parameters(), 784 * 256 + 256 + 7 * (256 * 256 + 256) + 2570);
  EXPECT_EQ(mlp->named_parameters().size(), 18u);

  auto cnn = create_model(model_cfg("cnn"));
  EXPECT_EQ(cnn->forward(torch::randn({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
  EXPECT_EQ(cnn->num_parameters(), 421642);

  auto gpt = create_model(model_cfg("gpt"));
  auto logits = gpt->forward(torch::randint(0, 256, {2, 128}, torch::kLong));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 128, 256}));
  // wte 256*256 + wpe 128*256 + 4 blocks * (2 LN + qkv + proj + fc + proj) + ln_f; no lm_head.
  const int64_t d = 256, block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
  EXPECT_EQ(gpt->num_parameters(), 256 * d + 128 * d + 4 * block + 2 * d);
  EXPECT_EQ(gpt->input_spec().kind, keel::models::InputKind::Tokens);
}

TEST(Models, GptIsCausal) {
  auto gpt = create_model(model_cfg("gpt"));
  auto x = torch::randint(0, 256, {1, 16}, torch::kLong);
  auto y = x.clone();
  y[0][10] = (x[0][10].item<int64_t>() + 1) % 256;
  auto a = gpt->forward(x), b = gpt->forward(y);
  EXPECT_TRUE(torch::allclose(a.narrow(1, 0, 10), b.narrow(1, 0, 10)));
  EXPECT_FALSE(torch::allclose(a.narrow(1, 10, 1), b.narrow(1, 10, 1)));
}

// model.dropout: gpt, gpt2 and llama drop out while training only. With dropout the training
// forward is random and the evaluation forward equals the same weights' without dropout; with
// none (the default) training and evaluation give the same logits.
TEST(Models, DropoutOnlyWhileTrainingAndOnlyWhereAsked) {
  for (const std::string name : {"gpt", "gpt2", "llama"}) {
    keel::ModelConfig c = model_cfg(name);
    c.width = 32;
    c.depth = 2;
    c.context = 16;
    c.vocab = 64;
    auto plain = create_model(c);
    c.dropout = 0.5;
    auto dropped = create_model(c);
    {
      torch::NoGradGuard ng;
      auto from = plain->named_parameters();
      auto to = dropped->named_parameters();
      ASSERT_EQ(from.size(), to.size()) << name;
      for (size_t i = 0; i < from.size(); ++i) to[i].second.copy_(from[i].second);
    }
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    plain->train(true);
    const auto reference = plain->forward(x);
    plain->train(false);
    EXPECT_TRUE(torch::equal(plain->forward(x), reference)) << name << ": no dropout, yet training differs";
    dropped->train(true);
    const auto a = dropped->forward(x), b = dropped->forward(x);
    EXPECT_FALSE(torch::allclose(a, b)) << name << ": two training forwards with dropout 0.5 agree";
    EXPECT_FALSE(torch::allclose(a, reference)) << name;
    dropped->train(false);
    EXPECT_TRUE(torch::allclose(dropped->forward(x), reference, 1e-5, 1e-6)) << name << ": dropout in evaluation";
  }
}

TEST(Models, RegistryListsBuiltinsAndAcceptsUserModels) {
  auto names = keel::models::registered_models();
  for (const char* n : {"mlp", "cnn", "gpt", "gpt2", "llama", "torchscript"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  keel::models::register_model("tiny", [](const keel::ModelConfig& c, std::optional<keel::models::InputKind>) {
    auto m = keel::models::make_mlp(c);
    return m;
  });
  EXPECT_EQ(create_model(model_cfg("tiny"))->name(), "mlp");
  EXPECT_THROW(create_model(model_cfg("nope")), keel::InputError);
}

TEST(Models, RegisteringANameTwiceIsAnError) {
  auto factory = [](const keel::ModelConfig& c, std::optional<keel::models::InputKind>) {
    return keel::models::make_mlp(c);
  };
  keel::models::register_model("twice", factory);
  for (const char* name : {"twice", "cnn"}) {
    try {
      keel::models::register_model(name, factory);
      ADD_FAILURE() << name << ": no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("\"") + name + "\" is already registered"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(keel::models::register_model("", factory), std::invalid_argument);
}

TEST(Models, TorchScriptModelTrains) {
  // tests/golden/tiny_classifier.pt: torch.jit.script of a 784->32->10 classifier
  // (made by tests/golden/make_torchscript.py).
  keel::ModelConfig c = model_cfg("torchscript");
  c.path = keel::testing::source_path("tests/golden/tiny_classifier.pt");
  auto m = create_model(c, keel::models::InputKind::Image);
  EXPECT_GT(m->num_parameters(), 0);
  auto x = torch::randn({4, 1, 28, 28});
  auto target = torch::tensor({1, 2, 3, 4}, torch::kLong);
  torch::optim::SGD opt(m->parameters(), 0.1);
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(m->forward(x), target);
    loss.backward();
    opt.step();
    (i == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 0.5);
}

// --- golden checks -------------------------------------------------------------------------

c10::Dict<c10::IValue, c10::IValue> load_golden(const std::string& file) {
  const std::string bytes = keel::testing::read_text(keel::testing::source_path("tests/golden/" + file));
  std::vector<char> data(bytes.begin(), bytes.end());
  return torch::pickle_load(data).toGenericDict();
}

torch::Tensor entry(const c10::Dict<c10::IValue, c10::IValue>& d, const std::string& key) {
  return d.at(c10::IValue(key)).toTensor();
}

// Tolerance: float32 on both sides, but PyTorch (Python) and keel may pick different kernels
// (oneDNN vs native convolution, blocked vs plain GEMM), which sum in different orders. For
// dot products of up to 3136 terms that moves results by ~1e-6 relative; rtol 1e-4 / atol 1e-5
// leaves margin for that while any architectural difference (a missing bias, a wrong mask, an
// untied head) is off by O(1).
void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double max_abs = (got - want).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(got, want, /*rtol=*/1e-4, /*atol=*/1e-5))
      << what << ": max abs diff " << max_abs << " (scale " << want.abs().max().item<double>() << ")";
}

void check_golden(keel::models::Model& m, const std::string& file) {
  auto g = load_golden(file);
  {
    torch::NoGradGuard ng;
    size_t loaded = 0;
    for (auto& [name, p] : m.named_parameters()) {
      const std::string key = "param/" + name;
      ASSERT_TRUE(g.contains(c10::IValue(key))) << "golden file lacks parameter " << name;
      auto src = entry(g, key);
      ASSERT_EQ(src.sizes(), p.sizes()) << name;
      p.copy_(src);
      ++loaded;
    }
    size_t golden_params = 0;
    for (const auto& kv : g)
      if (kv.key().toStringRef().rfind("param/", 0) == 0) ++golden_params;
    ASSERT_EQ(loaded, golden_params) << "keel and PyTorch models have different parameter sets";
  }
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
  auto logits = m.forward(entry(g, "input"));
  expect_close(logits, entry(g, "logits"), "logits");
  auto loss =
      torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), entry(g, "target").reshape({-1}));
  EXPECT_NEAR(loss.item<double>(), entry(g, "loss").item<double>(), 1e-5);
  loss.backward();
  for (auto& [name, p] : m.named_parameters()) expect_close(p.grad(), entry(g, "grad/" + name), "grad of " + name);
}

// Each transformer family's tensor-parallel plan (issue 45 applies it) names every matrix of its
// blocks exactly once, and each rule matches a parameter of the family (tied or untied).
TEST(Models, EachTransformerFamilysParallelPlanCoversEveryBlockMatrixOnce) {
  using keel::models::TransformerFamily;
  for (const TransformerFamily* f :
       {&keel::models::gpt_family(), &keel::models::gpt2_family(), &keel::models::llama_family()}) {
    std::set<std::string> used;
    for (const bool tied : {true, false}) {
      if (f->name == "gpt" && !tied) continue;
      auto c = model_cfg(f->name);
      c.depth = 2, c.width = 32, c.heads = 4, c.context = 8, c.vocab = 64, c.tie_embeddings = tied;
      keel::testing::TempDir dir;
      if (f->name == "llama") {  // with every bias transformers' Llama can have
        c = model_cfg("llama");
        c.init_from = dir.path();
        keel::testing::write_text(dir.file("config.json"), nlohmann::json{{"model_type", "llama"},
                                                                          {"vocab_size", 64},
                                                                          {"hidden_size", 32},
                                                                          {"num_hidden_layers", 2},
                                                                          {"num_attention_heads", 4},
                                                                          {"num_key_value_heads", 2},
                                                                          {"intermediate_size", 48},
                                                                          {"max_position_embeddings", 8},
                                                                          {"attention_bias", true},
                                                                          {"mlp_bias", true},
                                                                          {"tie_word_embeddings", tied}}
                                                               .dump());
      }
      auto model = f->factory(c);
      const auto blocks = model->block_prefixes();
      ASSERT_EQ(blocks.size(), 2u) << f->name;
      EXPECT_EQ(blocks[1], f->block_prefix + "1.") << f->name;
      for (const auto& [name, t] : model->named_parameters()) {
        int matches = 0;
        for (const auto& r : f->tp_plan)
          if (keel::models::tp_matches(name, r)) ++matches, used.insert(r.suffix);
        const bool in_block = name.rfind(f->block_prefix, 0) == 0;
        if (in_block && t.dim() == 2) EXPECT_EQ(matches, 1) << f->name << ": " << name;
        EXPECT_LE(matches, 1) << f->name << ": " << name;
      }
    }
    for (const auto& r : f->tp_plan)
      EXPECT_TRUE(used.count(r.suffix)) << f->name << ": rule " << r.suffix << " matches nothing";
  }
}

// The shared block keeps each family's parameter names and order (their checkpoint layout).
TEST(Models, TheSharedBlockKeepsEachFamilysParameterNamesInOrder) {
  auto names = [](const std::string& family) {
    auto c = model_cfg(family);
    c.depth = 1, c.width = 32, c.heads = 4, c.context = 8, c.vocab = 64;
    std::vector<std::string> out;
    for (const auto& [name, t] : create_model(c)->named_parameters()) out.push_back(name);
    return out;
  };
  EXPECT_EQ(names("gpt"), (std::vector<std::string>{
                              "wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight",
                              "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias",
                              "h.0.ln_2.weight", "h.0.ln_2.bias", "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias",
                              "h.0.mlp.c_proj.weight", "h.0.mlp.c_proj.bias", "ln_f.weight", "ln_f.bias"}));
  const auto llama = names("llama");
  EXPECT_EQ(
      std::vector<std::string>(llama.begin() + 1, llama.begin() + 10),
      (std::vector<std::string>{"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                                "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                                "model.layers.0.post_attention_layernorm.weight"}));
  const auto gpt2 = names("gpt2");
  EXPECT_EQ(gpt2[4], "transformer.h.0.attn.c_attn.weight");
}

TEST(Golden, CnnMatchesPyTorch) {
  auto m = create_model(model_cfg("cnn"));
  check_golden(*m, "cnn.pt");
}

// keel's gpt runs fused causal attention (at::scaled_dot_product_attention, is_causal); the
// golden file was made with the explicit masked softmax (reference_models.Gpt(sdpa=False)), so
// this also checks the two agree within expect_close's tolerance (rtol 1e-4, atol 1e-5).
TEST(Golden, GptMatchesPyTorch) {
  keel::ModelConfig c = model_cfg("gpt");
  c.width = 64;
  c.depth = 2;
  c.heads = 4;
  c.context = 16;
  auto m = create_model(c);
  check_golden(*m, "gpt_small.pt");
}

}  // namespace
