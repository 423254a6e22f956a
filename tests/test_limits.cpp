// Documented maxima against what a run can hold (docs/inputs.md, class 7): a key at the maximum
// the schema documents either runs or is refused before anything is allocated, exit 2 naming
// the key and the sizes (never "DefaultCPUAllocator: can't allocate", exit 1); train.beta1 and
// train.beta2 stop below 1, as torch's AdamW needs. The memory estimate
// (trainer/config/limits.h) is checked against the models keel builds.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "helpers.h"
#include "keel/models/model.h"
#include "keel/trainer/config/config.h"
#include "models/transformer.h"
#include "trainer/config/limits.h"

using keel::testing::run_keel;
using keel::testing::source_path;
using keel::testing::TempDir;

namespace {

const std::string kSmoke = "configs/synthetic_smoke.toml";

// "--model.width=1048576": the key at the maximum the schema documents.
std::string at_max(const std::string& key) {
  const keel::FieldInfo* f = keel::find_field(key);
  if (!f || !f->has_max) {
    ADD_FAILURE() << key << " has no documented maximum";
    return "--" + key + "=0";
  }
  return "--" + key + "=" + std::to_string(static_cast<int64_t>(f->max));
}

// `file` with the command-line options `extra` ("--section.key=value"), as keel resolves it.
keel::Config resolved(const std::string& file, const std::vector<std::string>& extra = {}) {
  keel::Config cfg;
  keel::load_toml_file(source_path(file), cfg);
  for (const auto& o : extra) {
    const auto eq = o.find('=');
    keel::apply_override(cfg, o.substr(2, eq - 2), o.substr(eq + 1));
  }
  keel::validate(cfg);
  return cfg;
}

// keel train on synthetic_smoke.toml with `extra` is exit 2 naming `key` (and telling to lower
// it), before anything is allocated.
void expect_refused_naming(const std::string& key, const std::vector<std::string>& extra) {
  const double need = keel::estimate_memory(resolved(kSmoke, extra), 1, /*on_cuda=*/false).host_bytes;
  const auto available = keel::available_memory_bytes();
  ASSERT_TRUE(available.has_value()) << "no /proc/meminfo and no sysconf(_SC_PHYS_PAGES)";
  if (*available >= need)
    GTEST_SKIP() << "this machine has " << *available << " bytes available: enough for " << need
                 << " (the config may run here)";
  TempDir d;
  std::vector<std::string> args = {"train",           "--config",         source_path(kSmoke),
                                   "--train.steps=2", "--run.device=cpu", "--run.dir=" + d.file("run")};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto r = run_keel(args, {}, 300);
  EXPECT_FALSE(r.signaled) << "ended by signal " << r.signal << "\n" << r.output;
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(key), std::string::npos) << "expected '" << key << "' in:\n" << r.output;
  EXPECT_NE(r.output.find("lower " + key), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("is available"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("can't allocate"), std::string::npos) << r.output;
}

// <d>/hf/config.json: a llama with grouped-query attention, a head_dim of its own and biases.
void write_llama_with_biases(const TempDir& d) {
  std::filesystem::create_directories(d.file("hf"));
  keel::testing::write_text(d.file("hf/config.json"),
                            R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                "intermediate_size": 48, "attention_bias": true, "mlp_bias": true,
                                "tie_word_embeddings": false})");
}

}  // namespace

TEST(Limits, ModelWidthAtItsMaximumIsRefusedNamingTheKey) {
  expect_refused_naming("model.width", {at_max("model.width")});  // mlp: 7 x 2^40 weights
}

TEST(Limits, ModelContextAtItsMaximumIsRefusedNamingTheKey) {
  // gpt on synthetic tokens: attention scores of 2^20 x 2^20 per head and sample.
  expect_refused_naming("model.context", {"--model.name=gpt", at_max("model.context")});
}

TEST(Limits, ModelNumClassesAtItsMaximumIsRefusedNamingTheKey) {
  // mlp: a Linear(256, 2^24) and a 784 x 2^24 labelling rule for the synthetic images.
  expect_refused_naming("model.num_classes", {at_max("model.num_classes")});
}

TEST(Limits, SyntheticSizeAtItsMaximumIsRefusedNamingTheKey) {
  expect_refused_naming("data.synthetic_size", {at_max("data.synthetic_size")});  // 2^28 images of 3136 bytes
}

TEST(Limits, BetaOfOneIsRefusedNamingTheKeyAndBelowOneTrains) {
  // The config layer: the file and the command line.
  for (const std::string key : {"beta1", "beta2"}) {
    keel::Config cfg;
    std::string error;
    try {
      keel::load_toml_string("[train]\n" + key + " = 1.0\n", "beta.toml", cfg);
      keel::validate(cfg);
    } catch (const keel::InputError& e) {
      error = e.what();
    }
    EXPECT_NE(error.find("train." + key), std::string::npos) << "'" << error << "'";
    keel::Config ok;
    keel::load_toml_string("[train]\n" + key + " = 0.99999\n", "beta.toml", ok);
    EXPECT_NO_THROW(keel::validate(ok));
  }
  // The binary: exit 2 naming the key, not torch's "Invalid beta parameter" (exit 1).
  TempDir d;
  const std::vector<std::string> base = {"train",           "--config",         source_path(kSmoke),
                                         "--train.steps=2", "--run.device=cpu", "--run.dir=" + d.file("run")};
  for (const std::string key : {"train.beta1", "train.beta2"}) {
    auto args = base;
    args.push_back("--" + key + "=1.0");
    const auto r = run_keel(args);
    EXPECT_FALSE(r.signaled) << r.output;
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(key), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Invalid beta parameter"), std::string::npos) << r.output;
  }
  auto args = base;
  args.push_back("--train.beta2=0.99999");
  const auto r = run_keel(args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// The estimate counts the parameters the models build, exactly.
TEST(Limits, ParameterEstimateIsWhatTheModelsBuild) {
  struct Case {
    const char* name;
    int64_t width, depth, heads, context, vocab, classes;
  };
  const std::vector<Case> cases = {{"mlp", 0, 0, 4, 128, 256, 10}, {"mlp", 32, 2, 4, 128, 256, 7},
                                   {"mlp", 16, 1, 4, 128, 256, 3}, {"cnn", 0, 0, 4, 128, 256, 10},
                                   {"cnn", 0, 0, 4, 128, 256, 33}, {"gpt", 0, 0, 4, 128, 256, 10},
                                   {"gpt", 32, 2, 4, 16, 256, 10}, {"gpt", 16, 3, 2, 8, 50, 10}};
  for (const auto& c : cases) {
    keel::ModelConfig m;
    m.name = c.name;
    m.width = c.width;
    m.depth = c.depth;
    m.heads = c.heads;
    m.context = c.context;
    m.vocab = c.vocab;
    m.num_classes = c.classes;
    const auto estimate = keel::estimate_parameters(m);
    ASSERT_TRUE(estimate.has_value()) << c.name;
    const auto model = keel::models::create_model(m);
    EXPECT_EQ(static_cast<int64_t>(*estimate), model->num_parameters())
        << c.name << " width " << c.width << " depth " << c.depth << " classes " << c.classes;
  }
  // The Hugging Face families (issue 44, item 5: they had no estimate, so a model far larger than
  // the machine was allocated until the allocator failed): from the [model] keys, grouped-query
  // attention and an untied head included, and from a config.json with biases.
  struct HfCase {
    const char* name;
    int64_t width, depth, heads, kv_heads, ffn, vocab;
    bool tied;
  };
  for (const auto& c : std::vector<HfCase>{{"gpt2", 32, 2, 4, 0, 0, 96, true},
                                           {"gpt2", 48, 1, 4, 0, 100, 64, false},
                                           {"llama", 32, 2, 4, 0, 64, 96, true},
                                           {"llama", 64, 2, 8, 2, 96, 80, false}}) {
    keel::ModelConfig m;
    m.name = c.name;
    m.width = c.width;
    m.depth = c.depth;
    m.heads = c.heads;
    m.kv_heads = c.kv_heads;
    m.ffn_width = c.ffn;
    m.vocab = c.vocab;
    m.context = 16;
    m.tie_embeddings = c.tied;
    const auto estimate = keel::estimate_parameters(m);
    ASSERT_TRUE(estimate.has_value()) << c.name;
    EXPECT_EQ(static_cast<int64_t>(*estimate), keel::models::create_model(m)->num_parameters())
        << c.name << " width " << c.width << " kv_heads " << c.kv_heads << " tied " << c.tied;
  }
  keel::testing::TempDir d;
  write_llama_with_biases(d);
  keel::ModelConfig from_file;
  from_file.name = "llama";
  from_file.context = 16;
  from_file.init_from = d.file("hf");
  EXPECT_EQ(static_cast<int64_t>(*keel::estimate_parameters(from_file)),
            keel::models::create_model(from_file)->num_parameters())
      << "llama from a config.json with biases and head_dim";
  keel::ModelConfig mlp, cnn, ts;
  mlp.name = "mlp";
  cnn.name = "cnn";
  ts.name = "torchscript";
  EXPECT_EQ(*keel::estimate_parameters(mlp), 664074);  // 784 -> 8 x 256 -> 10
  EXPECT_EQ(*keel::estimate_parameters(cnn), 421642);  // the benchmark table's CNN
  EXPECT_FALSE(keel::estimate_parameters(ts).has_value());
}

TEST(Limits, MemoryEstimateAcceptsTheShippedConfigsAndNamesTheKeyOfOneThatCannotFit) {
  // Every shipped config fits in 4 GB, 2 ranks on the host.
  for (const char* file : {"configs/synthetic_smoke.toml", "configs/fashion_mnist_cnn.toml",
                           "configs/fashion_mnist_mlp.toml", "configs/gpt_text.toml"}) {
    const keel::Config cfg = resolved(file);
    EXPECT_LT(keel::estimate_memory(cfg, 2, false).host_bytes, 1e9) << file;
    EXPECT_EQ(keel::memory_problem(cfg, 2, 2, false, 4e9), "") << file;
  }

  // synthetic_smoke: the mlp's parameters, gradients and AdamW's two moments, float32; the
  // images of both splits.
  const keel::Config smoke = resolved(kSmoke);
  const keel::MemoryEstimate e = keel::estimate_memory(smoke, 1, false);
  EXPECT_EQ(e.parameters, 664074);
  EXPECT_DOUBLE_EQ(e.model_bytes, 664074.0 * 4 * 4);
  EXPECT_GE(e.data_bytes, (4096 + 1024) * 784 * 4.0);
  EXPECT_GT(e.activation_bytes, 0);
  EXPECT_GE(e.host_bytes, e.model_bytes + e.data_bytes * 0.5);
  EXPECT_LT(e.host_bytes, 2e8);
  // SGD without momentum keeps no state; ZeRO partitions AdamW's.
  const keel::Config sgd = resolved(kSmoke, {"--train.optimizer=sgd", "--train.momentum=0"});
  EXPECT_DOUBLE_EQ(keel::estimate_memory(sgd, 1, false).model_bytes, 664074.0 * 4 * 2);
  const keel::Config zero = resolved(kSmoke, {"--dist.zero=1"});
  EXPECT_DOUBLE_EQ(keel::estimate_memory(zero, 4, false).model_bytes, 664074.0 * 4 * (2 + 2.0 / 4));
  // Ranks on one host each hold a copy.
  EXPECT_EQ(keel::memory_problem(smoke, 8, 8, false, 8 * e.host_bytes + 1), "");
  EXPECT_NE(keel::memory_problem(smoke, 8, 8, false, 8 * e.host_bytes - 1), "");
  // On a GPU only the parameters (built on the CPU) and the data are in host memory; the
  // model state and the activations are checked against the GPU's free memory when known.
  EXPECT_LT(keel::estimate_memory(smoke, 1, true).host_bytes, e.host_bytes);
  EXPECT_DOUBLE_EQ(keel::estimate_memory(smoke, 1, true).device_bytes, e.model_bytes + e.activation_bytes);
  EXPECT_EQ(keel::memory_problem(smoke, 1, 1, true, 1e12, 80e9), "");
  const keel::Config long_context = resolved(kSmoke, {"--model.name=gpt", "--model.context=1048576"});
  EXPECT_EQ(keel::memory_problem(long_context, 1, 1, true, 1e12), "");  // the GPU's memory unknown
  const std::string gpu_problem = keel::memory_problem(long_context, 1, 1, true, 1e12, 80e9);
  for (const char* want : {"GPU memory", "80.0 GB is free", "lower model.context"})
    EXPECT_NE(gpu_problem.find(want), std::string::npos) << "'" << want << "' not in: " << gpu_problem;

  // A wide mlp: 1.3e10 parameters, 207 GB with gradients and AdamW state.
  const keel::Config wide = resolved(kSmoke, {"--model.width=65536", "--model.depth=4"});
  const std::string problem = keel::memory_problem(wide, 1, 1, false, 20e9);
  for (const char* want :
       {"model.width = 65536", "model.depth = 4", "AdamW", "207.0 GB", "20.0 GB is available", "lower model.width"})
    EXPECT_NE(problem.find(want), std::string::npos) << "'" << want << "' not in: " << problem;
  EXPECT_LT(problem.size(), 2000u) << problem;  // whole through first_error's 2 KiB
  // Not the parameters but the data: the key to lower is the data's.
  const keel::Config big_data = resolved(kSmoke, {"--data.synthetic_size=16777216"});
  const std::string data_problem = keel::memory_problem(big_data, 1, 1, false, 20e9);
  EXPECT_NE(data_problem.find("lower data.synthetic_size"), std::string::npos) << data_problem;
}

// Issue 64 item 2: the memory pre-check counts a rank of parallel.tp = t as holding its share,
// (P - P_r) / t + P_r of the parameters (docs/parallel.md), with gradients and optimizer state,
// and 1/t of what lies inside the regions of a micro-batch's activations. It counted the whole
// model on every rank and refused, advising a smaller model.width, the configs tp exists for.
TEST(Limits, AtTpEachRankIsCountedItsShareAndAConfigThatFitsIsNeverRefused) {
  // P_r is what the family's tp plan leaves whole, counted on the built models.
  TempDir d;
  write_llama_with_biases(d);
  for (const std::string name : {"gpt", "gpt2", "llama", "llama from config.json"}) {
    keel::ModelConfig m;
    m.name = name.substr(0, name.find(' '));
    m.width = 32;
    m.depth = 2;
    m.heads = 4;
    m.context = 16;
    m.vocab = 64;
    if (name != m.name) m.init_from = d.file("hf");
    const auto* family = keel::models::transformer_family(m.name);
    ASSERT_NE(family, nullptr) << name;
    int64_t replicated = 0;
    for (const auto& [n, p] : keel::models::create_model(m)->named_parameters())
      if (!keel::models::tp_rule(family->tp_plan, n)) replicated += p.numel();
    const auto estimate = keel::estimate_replicated_parameters(m);
    ASSERT_TRUE(estimate.has_value()) << name;
    EXPECT_EQ(static_cast<int64_t>(*estimate), replicated) << name;
  }
  keel::ModelConfig mlp;
  mlp.name = "mlp";
  EXPECT_FALSE(keel::estimate_replicated_parameters(mlp).has_value());

  // A gpt of 4.9e8 parameters: per rank of tp 2 its share, with gradients and AdamW's two moments.
  const std::vector<std::string> gpt = {"--model.name=gpt", "--model.width=2048", "--model.depth=8",
                                        "--model.context=256", "--train.batch_size=2"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), gpt.begin(), gpt.end());
    return resolved(kSmoke, extra);
  };
  const keel::Config tp1 = with({}), tp2 = with({"--parallel.tp=2"}),
                     tp2_sp = with({"--parallel.tp=2", "--parallel.sequence_parallel=true"});
  const double P = *keel::estimate_parameters(tp1.model), Pr = *keel::estimate_replicated_parameters(tp1.model);
  const keel::MemoryEstimate e1 = keel::estimate_memory(tp1, 1, false), e2 = keel::estimate_memory(tp2, 1, false);
  EXPECT_DOUBLE_EQ(e1.model_bytes, 16 * P);
  EXPECT_DOUBLE_EQ(e2.model_bytes, 16 * ((P - Pr) / 2 + Pr));
  EXPECT_LT(e2.activation_bytes, e1.activation_bytes);
  EXPECT_GT(e2.activation_bytes, e1.activation_bytes / 2) << "the norms' tensors stay whole without sp";
  EXPECT_LT(keel::estimate_memory(tp2_sp, 1, false).activation_bytes, e2.activation_bytes);
  EXPECT_LT(e2.host_bytes, 0.6 * e1.host_bytes);
  // At the edge, both sides: 2 ranks of tp 2 on one host fit in twice a rank's estimate, and not
  // in a byte less; the whole model on each rank would not fit there (the refusal before the fix).
  const double fits = 2 * e2.host_bytes + 1, short_by_one = 2 * e2.host_bytes - 1;
  EXPECT_EQ(keel::memory_problem(tp2, 1, 2, false, fits), "");
  const std::string refused = keel::memory_problem(tp2, 1, 2, false, short_by_one);
  for (const char* want : {"one rank of parallel.tp = 2 holds", "per rank x 2 ranks on this host"})
    EXPECT_NE(refused.find(want), std::string::npos) << "'" << want << "' not in: " << refused;
  EXPECT_NE(keel::memory_problem(tp1, 1, 2, false, fits), "");
  // With ZeRO over dp 2 as well: the tp share divided again, and the edge holds on 4 ranks.
  const keel::Config tp2_zero3 = with({"--parallel.tp=2", "--dist.zero=3"});
  const keel::MemoryEstimate e4 = keel::estimate_memory(tp2_zero3, 2, false);
  EXPECT_DOUBLE_EQ(e4.model_bytes, 16 * ((P - Pr) / 2 + Pr) / 2);
  EXPECT_EQ(keel::memory_problem(tp2_zero3, 2, 4, false, 4 * e4.host_bytes + 1), "");
  EXPECT_NE(keel::memory_problem(tp2_zero3, 2, 4, false, 4 * e4.host_bytes - 1), "");
  // Built whole and then sliced (model.sharded_init = false): the whole model in host memory first.
  const keel::Config whole_build = with({"--parallel.tp=2", "--model.sharded_init=false"});
  EXPECT_GE(keel::estimate_memory(whole_build, 1, false).host_bytes, 4 * P);
  // On a GPU, each rank's share against its GPU's free memory.
  EXPECT_DOUBLE_EQ(keel::estimate_memory(tp2, 1, true).device_bytes, e2.model_bytes + e2.activation_bytes);
}

// Issue 64 item 3: a Hugging Face family read from model.init_from's config.json is estimated
// from the file's values and the message names the file's fields (it said "model.vocab = 0 (the
// default, ...)" for the file's vocab_size).
TEST(Limits, AModelFromAConfigJsonIsNamedByTheFilesFields) {
  TempDir d;
  std::filesystem::create_directories(d.file("hf"));
  const std::string file = d.file("hf") + "/config.json";
  keel::testing::write_text(file, R"({"model_type": "gpt2", "vocab_size": 4000000, "n_positions": 64,
                                      "n_embd": 4096, "n_layer": 2, "n_head": 32})");
  const keel::Config cfg =
      resolved(kSmoke, {"--model.name=gpt2", "--model.context=64", "--model.init_from=" + d.file("hf")});
  const std::string problem = keel::memory_problem(cfg, 1, 1, false, 20e9);
  for (const std::string& want :
       {std::string("vocab_size = 4000000 in ") + file, "n_embd = 4096 in " + file, "lower vocab_size in " + file})
    EXPECT_NE(problem.find(want), std::string::npos) << "'" << want << "' not in: " << problem;
  EXPECT_EQ(problem.find("model.vocab"), std::string::npos) << problem;
}
