// Config: one test per bad-input class, overrides, and the resolved-config round trip.
#include <gtest/gtest.h>

#include <filesystem>

#include "helpers.h"
#include "keel/trainer/config/config.h"

using keel::Config;
using keel::InputError;

namespace {

// Loads `text` and returns the InputError message ("" if it loaded).
std::string load_error(const std::string& text) {
  Config cfg;
  try {
    keel::load_toml_string(text, "test.toml", cfg);
    keel::validate(cfg);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Config, DefaultsValidate) {
  Config cfg;
  keel::validate(cfg);
  EXPECT_EQ(cfg.run.dir, "runs/keel");
  EXPECT_EQ(cfg.train.batch_size, 64);
  EXPECT_TRUE(cfg.data.drop_last);
  EXPECT_EQ(cfg.dist.timeout_s, 300);
  EXPECT_EQ(cfg.dist.bucket_cap_mb, 25.0);
  EXPECT_EQ(cfg.compile.max_recompiles, 8);
  EXPECT_EQ(cfg.amp.init_scale, 65536.0);
  EXPECT_EQ(cfg.checkpoint.keep, 3);
}

TEST(Config, LoadsValuesAndRecordsExplicitKeys) {
  Config cfg;
  keel::load_toml_string("[train]\nlr = 0.5\nbatch_size = 7\n[model]\nname = \"mlp\"\n", "t.toml", cfg);
  EXPECT_DOUBLE_EQ(cfg.train.lr, 0.5);
  EXPECT_EQ(cfg.train.batch_size, 7);
  EXPECT_EQ(cfg.model.name, "mlp");
  EXPECT_TRUE(cfg.is_explicit("train.lr"));
  EXPECT_FALSE(cfg.is_explicit("train.steps"));
}

TEST(Config, IntegerAcceptedForFloatKey) {
  Config cfg;
  keel::load_toml_string("[train]\nlr = 1\n", "t.toml", cfg);
  EXPECT_DOUBLE_EQ(cfg.train.lr, 1.0);
}

TEST(ConfigErrors, MalformedTomlNamesFileLineColumn) {
  auto msg = load_error("[train]\nlr = = 3\n");
  EXPECT_NE(msg.find("test.toml:2:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("syntax error"), std::string::npos) << msg;
}

TEST(ConfigErrors, UnknownSection) {
  auto msg = load_error("[trainer]\nlr = 3\n");
  EXPECT_NE(msg.find("unknown section [trainer]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("test.toml:1:"), std::string::npos) << msg;
}

TEST(ConfigErrors, UnknownKeyWithSuggestion) {
  auto msg = load_error("[train]\nbatch_sise = 3\n");
  EXPECT_NE(msg.find("unknown key 'train.batch_sise'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'train.batch_size'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("test.toml:2:"), std::string::npos) << msg;
}

// The token-file keys are refused where a built-in dataset would ignore them; an unknown dtype
// names the choices.
TEST(ConfigErrors, TokenFileKeysWithAnotherDataset) {
  auto msg = load_error("[data]\nname = \"text\"\ntest_path = \"v.bin\"\n");
  EXPECT_NE(msg.find("data.test_path is read only with data.name = \"tokens\""), std::string::npos) << msg;
  msg = load_error("[data]\ntoken_dtype = \"uint32\"\n");
  EXPECT_NE(msg.find("data.token_dtype is read only with data.name = \"tokens\" (data.name = \"fashion_mnist\")"),
            std::string::npos)
      << msg;
  msg = load_error("[data]\nname = \"tokens\"\ntoken_dtype = \"int8\"\n");
  EXPECT_NE(msg.find("uint16"), std::string::npos) << msg;
  EXPECT_EQ(
      load_error("[data]\nname = \"tokens\"\npath = \"t.bin\"\ntoken_dtype = \"uint32\"\ntest_path = \"v.bin\"\n"), "");
}

// The Hugging Face families' keys given to a built-in model that does not read them are refused
// by name instead of being ignored; each family takes its own.
TEST(ConfigErrors, HfFamilyKeysWithAModelThatDoesNotReadThem) {
  auto msg = load_error("[model]\nname = \"gpt2\"\nkv_heads = 2\n");
  EXPECT_NE(msg.find("model.kv_heads is read only with model.name = \"llama\" (model.name = \"gpt2\")"),
            std::string::npos)
      << msg;
  msg = load_error("[model]\nname = \"gpt2\"\nrope_theta = 500000.0\n");
  EXPECT_NE(msg.find("model.rope_theta is read only with model.name = \"llama\""), std::string::npos) << msg;
  msg = load_error("[model]\nname = \"gpt\"\nffn_width = 128\n");
  EXPECT_NE(msg.find("model.ffn_width is read only with model.name = \"gpt2\" or \"llama\" (model.name = \"gpt\")"),
            std::string::npos)
      << msg;
  msg = load_error("[model]\nname = \"mlp\"\ntie_embeddings = false\n");
  EXPECT_NE(msg.find("model.tie_embeddings is read only with"), std::string::npos) << msg;
  EXPECT_EQ(load_error("[model]\nname = \"llama\"\nkv_heads = 2\nrope_theta = 500000.0\nffn_width = 128\n"), "");
  EXPECT_EQ(load_error("[model]\nname = \"gpt2\"\nffn_width = 128\nnorm_eps = 1e-6\ntie_embeddings = false\n"), "");
  EXPECT_EQ(load_error("[model]\nname = \"gpt2\"\nkv_heads = 0\n"), "");  // the default: nothing to ignore
}

TEST(ConfigErrors, KeyOutsideSection) {
  auto msg = load_error("lr = 3\n");
  EXPECT_NE(msg.find("outside any section"), std::string::npos) << msg;
}

TEST(ConfigErrors, WrongType) {
  auto msg = load_error("[train]\nbatch_size = \"64\"\n");
  EXPECT_NE(msg.find("'train.batch_size' expects int, got string"), std::string::npos) << msg;
  msg = load_error("[train]\nsteps = 1.5\n");
  EXPECT_NE(msg.find("'train.steps' expects int, got float"), std::string::npos) << msg;
  msg = load_error("[data]\ndrop_last = 1\n");
  EXPECT_NE(msg.find("'data.drop_last' expects bool"), std::string::npos) << msg;
}

TEST(ConfigErrors, OutOfRange) {
  auto msg = load_error("[train]\nbatch_size = 0\n");
  EXPECT_NE(msg.find("'train.batch_size' = 0 is out of range"), std::string::npos) << msg;
  msg = load_error("[train]\nlr = -1.0\n");
  EXPECT_NE(msg.find("'train.lr' = -1.0 is out of range"), std::string::npos) << msg;
  msg = load_error("[train]\nlr = nan\n");
  EXPECT_NE(msg.find("finite"), std::string::npos) << msg;
}

TEST(ConfigErrors, NotAChoice) {
  // (train.optimizer is a registered name now: Registries.AnOptimizerRegisteredByName... refuses "adam")
  auto msg = load_error("[compile]\nmode = \"jit\"\n");
  EXPECT_NE(msg.find("'compile.mode' = \"jit\" is not one of: off, trace, inductor"), std::string::npos) << msg;
}

TEST(ConfigErrors, BinaryFile) {
  std::string bin(
      "\x7f"
      "ELF\x02\x01\x01\0\0\0\0",
      12);
  auto msg = load_error(bin);
  EXPECT_NE(msg.find("not a TOML file"), std::string::npos) << msg;
  // Invalid UTF-8 without NUL bytes is refused by the parser.
  msg = load_error("[run]\nname = \"\xff\xfe\"\n");
  EXPECT_NE(msg.find("test.toml:2:"), std::string::npos) << msg;
}

TEST(ConfigErrors, MissingFile) {
  Config cfg;
  EXPECT_THROW(keel::load_toml_file("/nonexistent/keel.toml", cfg), InputError);
}

TEST(ConfigErrors, CrossFieldRules) {
  EXPECT_NE(load_error("[train]\nsteps = 10\nepochs = 2\n").find("not both"), std::string::npos);
  EXPECT_NE(load_error("[train]\nlr = 0.1\nmin_lr = 0.2\n").find("train.min_lr"), std::string::npos);
  EXPECT_NE(load_error("[model]\nname = \"torchscript\"\n").find("model.path"), std::string::npos);
  EXPECT_NE(load_error("[checkpoint]\nasync = true\nkeep = 1\n").find("checkpoint.keep"), std::string::npos);
}

// [parallel]'s pipeline keys (issue 66): a schedule that cannot be made for parallel.pp and
// train.grad_accum, an unknown one, virtual stages a schedule does not take, a split that does not
// parse or has another number of stages, and pp with a model without blocks are refused naming the
// keys; pp = 1 ignores the others; a schedule that fits validates.
TEST(ConfigErrors, PipelineKeysAreRefusedNamingThem) {
  const std::string gpt = "[model]\nname = \"gpt\"\n";
  const std::string pp4 = gpt + "[parallel]\npp = 4\n";
  auto expect = [](const std::string& error, const std::string& part) {
    EXPECT_NE(error.find(part), std::string::npos) << "wanted \"" << part << "\" in: " << error;
  };
  expect(load_error(pp4 + "[train]\ngrad_accum = 2\n"),
         "parallel.pp_schedule = \"1f1b\" at parallel.pp = 4 with train.grad_accum = 2 micro-batches");
  expect(load_error(pp4 + "[train]\ngrad_accum = 2\n"), "at least as many micro-batches as pp ranks");
  expect(load_error(pp4 + "pp_schedule = \"zigzag\"\n"), "'parallel.pp_schedule' = \"zigzag\" is not one of");
  expect(load_error(pp4 + "pp_schedule = \"zbv\"\npp_virtual_stages = 3\n[train]\ngrad_accum = 8\n"),
         "runs two stages per rank (a V), not 3");
  expect(load_error(pp4 + "pp_schedule = \"gpipe\"\npp_split = \"1,x,3\"\n"),
         "parallel.pp_split = \"1,x,3\": \"x\" is not a block");
  expect(load_error(pp4 + "pp_schedule = \"gpipe\"\npp_split = \"1,3,2\"\n"), "block 2 does not come after block 3");
  expect(load_error(pp4 + "pp_schedule = \"gpipe\"\npp_split = \"1,2\"\n"), "2 boundaries for 4 stages");
  expect(load_error("[model]\nname = \"mlp\"\n[parallel]\npp = 2\n[train]\ngrad_accum = 2\n"),
         "parallel.pp = 2 splits a model's blocks into stages");
  EXPECT_EQ(load_error(pp4 + "pp_schedule = \"gpipe\"\npp_split = \"1,2,3\"\n"), "");
  EXPECT_EQ(load_error(pp4 + "pp_schedule = \"interleaved\"\n[train]\ngrad_accum = 8\n"), "");
  EXPECT_EQ(load_error(gpt + "[parallel]\npp_schedule = \"dualpipev\"\n"), "");  // pp = 1: no schedule runs
}

// checkpoint.dir's commits and rotation replace and remove what is in it: a run directory or a
// compile cache inside it would lose its files to a rotation (issue 64, item 4); refused, named.
// checkpoint.dir inside run.dir (the usual layout), or the same, is fine.
TEST(ConfigErrors, DirectoriesInsideCheckpointDirAreRefusedNamingTheKey) {
  const std::string inside_run = load_error("[run]\ndir = \"x/ckpt/run\"\n[checkpoint]\ndir = \"x/ckpt\"\n");
  EXPECT_NE(inside_run.find("run.dir = \"x/ckpt/run\" is inside checkpoint.dir = \"x/ckpt\""), std::string::npos)
      << inside_run;
  const std::string inside_cache =
      load_error("[compile]\ncache_dir = \"x/ckpt/./c\"\n[checkpoint]\ndir = \"x/ckpt/\"\n");
  EXPECT_NE(inside_cache.find("compile.cache_dir = \"x/ckpt/./c\" is inside checkpoint.dir"), std::string::npos)
      << inside_cache;
  EXPECT_EQ(load_error("[run]\ndir = \"x\"\n[checkpoint]\ndir = \"x/ckpt\"\n"), "");
  EXPECT_EQ(load_error("[run]\ndir = \"x/ckpt\"\n[checkpoint]\ndir = \"x/ckpt\"\n"), "");
  EXPECT_EQ(load_error("[run]\ndir = \"x/ckpt2\"\n[checkpoint]\ndir = \"x/ckpt\"\n"), "");
}

// A CPU build refuses CUDA-only settings while loading the config; a CUDA build accepts them
// and refuses them at start where there is no GPU (CliNoGpu.*).
TEST(ConfigErrors, CudaOnlySettingsInACpuBuild) {
  if (KEEL_CUDA_BUILD) GTEST_SKIP() << "a CUDA build: checked at start instead (CliNoGpu.*)";
  EXPECT_NE(load_error("[dist]\nbackend = \"nccl\"\n").find("CUDA"), std::string::npos);
  EXPECT_NE(load_error("[amp]\ndtype = \"fp16\"\n").find("CUDA"), std::string::npos);
}

// compile.cuda_graphs: each combination a captured step cannot serve is refused by its keys; the
// rehearsal (compile.cuda_graphs_rehearsal) takes the same refusals on the CPU, with Gloo.
TEST(ConfigErrors, CudaGraphsRefuseWhatAGraphCannotServe) {
  const std::string on = "[compile]\ncuda_graphs = true\n";
  const std::string rehearsed = "[compile]\ncuda_graphs = true\ncuda_graphs_rehearsal = true\n";
  if (!KEEL_CUDA_BUILD) {
    const std::string m = load_error(on);
    EXPECT_NE(m.find("needs a CUDA build"), std::string::npos) << m;
    EXPECT_NE(m.find("compile.cuda_graphs_rehearsal = true"), std::string::npos) << m;
  } else {
    const std::string cpu = load_error(on + "[run]\ndevice = \"cpu\"\n");
    EXPECT_NE(cpu.find("compile.cuda_graphs"), std::string::npos) << cpu;
    EXPECT_NE(cpu.find("run.device = \"cpu\""), std::string::npos) << cpu;
    const std::string gloo = load_error(on + "[dist]\nbackend = \"gloo\"\n");
    EXPECT_NE(gloo.find("dist.backend = \"gloo\""), std::string::npos) << gloo;
  }
  const std::string cpu = "[run]\ndevice = \"cpu\"\n";
  EXPECT_NE(load_error(rehearsed).find("set run.device = \"cpu\""), std::string::npos);
  EXPECT_NE(load_error("[compile]\ncuda_graphs_rehearsal = true\n" + cpu).find("set both, or neither"),
            std::string::npos);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"[dist]\nfind_unused_parameters = true\n", "dist.find_unused_parameters = true"},
      {"[dist]\nconsensus = \"step\"\n", "dist.consensus = \"step\""},
      {"[dist]\nzero = 3\n", "dist.zero = 3"},
      {"[train]\nfused_optimizer = false\n", "train.fused_optimizer = true"},
      {"[train]\ngrads_to_none = true\n", "train.grads_to_none = true"},
      {"[train]\nactivation_checkpointing = \"blocks\"\n", "train.activation_checkpointing = \"blocks\""},
      {"[model]\nname = \"gpt\"\ndropout = 0.1\n[parallel]\ntp = 2\n", "dropout 0.1 (model.dropout)"},
  };
  for (const auto& [toml, key] : refused) {
    const std::string m = load_error(rehearsed + cpu + toml);
    EXPECT_NE(m.find("compile.cuda_graphs = true"), std::string::npos) << toml << ": " << m;
    EXPECT_NE(m.find(key), std::string::npos) << toml << ": " << m;
  }
  // What it serves loads.
  Config ok;
  keel::load_toml_string(rehearsed + cpu + "[dist]\nzero = 2\n", "t.toml", ok);
  EXPECT_NO_THROW(keel::validate(ok));
}

// Issue 64 item 3: every check reads the value the model is built with, and names where it came
// from. With model.init_from's config.json the heads, the vocabulary and the dropout are the
// file's: compile.cuda_graphs at tp 2 refused the dropout of model.dropout but took the same
// dropout from the file (captured and replayed), and a refusal of heads that do not divide named
// model.heads for the file's n_head.
TEST(ConfigErrors, ValuesFromInitFromsConfigJsonAreCheckedAndNamedByTheirFile) {
  keel::testing::TempDir d;
  std::filesystem::create_directories(d.file("hf"));
  const std::string file = d.file("hf") + "/config.json";
  keel::testing::write_text(file, R"({"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 48,
                                       "n_layer": 1, "n_head": 6, "attn_pdrop": 0.2, "embd_pdrop": 0.0,
                                       "resid_pdrop": 0.0})");
  const std::string model = "[model]\nname = \"gpt2\"\ncontext = 16\ninit_from = \"" + d.file("hf") + "\"\n";
  const std::string rehearsed =
      "[compile]\ncuda_graphs = true\ncuda_graphs_rehearsal = true\n[run]\ndevice = \"cpu\"\n";
  // n_head = 6 does not divide by tp 4: named as the file's field.
  const std::string heads = load_error(model + "[parallel]\ntp = 4\n");
  EXPECT_NE(heads.find("model.heads = 6 (n_head in " + file + ")"), std::string::npos) << heads;
  // The file's attn_pdrop under CUDA graphs at tp 2: refused, naming the file and its fields.
  const std::string dropout = load_error(model + rehearsed + "[parallel]\ntp = 2\n");
  for (const std::string& want :
       std::vector<std::string>{"compile.cuda_graphs = true", "dropout 0.2", "attn_pdrop = 0.2", file})
    EXPECT_NE(dropout.find(want), std::string::npos) << "'" << want << "' not in: " << dropout;
  // model.dropout = 0 over the file's: what a graph serves loads.
  EXPECT_EQ(load_error(model + "dropout = 0.0\n" + rehearsed + "[parallel]\ntp = 2\n"), "");
  // A [model] key set to another value than the file's is refused naming both, keel's default
  // value and the keys beyond the sizes included (the adversarial round: taken silently).
  for (const auto& [toml, want] : std::vector<std::pair<std::string, std::string>>{
           {"vocab = 256\n", "model.vocab = 256, but " + file + " has vocab_size = 64"},
           {"tie_embeddings = false\n",
            "model.tie_embeddings = false, but " + file + " has tie_word_embeddings = true"},
           {"norm_eps = 0.1\n", "model.norm_eps = 0.1, but " + file + " has layer_norm_epsilon = 1e-05"}}) {
    const std::string m = load_error(model + toml);
    EXPECT_NE(m.find(want), std::string::npos) << toml << ": " << m;
  }
  EXPECT_EQ(load_error(model + "vocab = 64\nwidth = 48\n"), "") << "the file's own values agree";
  // The resolved config (run.dir/config.toml: every key written) holds the file's values, so it
  // replays the run.
  {
    Config run;
    keel::load_toml_string(model, "run.toml", run);
    keel::validate(run);
    const std::string resolved = keel::dump_toml(run);
    EXPECT_NE(resolved.find("heads = 6"), std::string::npos) << resolved;
    EXPECT_NE(resolved.find("width = 48"), std::string::npos) << resolved;
    Config replay;
    keel::load_toml_string(resolved, "config.toml", replay);
    EXPECT_NO_THROW(keel::validate(replay));
  }
  // A [model] key's own value is still named as the key.
  const std::string key =
      load_error("[model]\nname = \"gpt2\"\nheads = 6\nwidth = 48\nvocab = 64\n[parallel]\ntp = 4\n");
  EXPECT_NE(key.find("model.heads = 6 over tp ranks"), std::string::npos) << key;
}

TEST(ConfigOverrides, ParsesEachType) {
  Config cfg;
  keel::apply_override(cfg, "train.lr", "0.25");
  keel::apply_override(cfg, "train.steps", "12");
  keel::apply_override(cfg, "data.drop_last", "false");
  keel::apply_override(cfg, "model.name", "gpt");
  EXPECT_DOUBLE_EQ(cfg.train.lr, 0.25);
  EXPECT_EQ(cfg.train.steps, 12);
  EXPECT_FALSE(cfg.data.drop_last);
  EXPECT_EQ(cfg.model.name, "gpt");
}

TEST(ConfigOverrides, ListReplacesFileThenAppends) {
  Config cfg;
  keel::load_toml_string("[fault]\ninject = [\"a@step=1,rank=0\"]\n", "t.toml", cfg);
  keel::apply_override(cfg, "fault.inject", "b@step=2,rank=1");
  keel::apply_override(cfg, "fault.inject", "c@step=3,rank=0");
  ASSERT_EQ(cfg.fault.inject.size(), 2u);
  EXPECT_EQ(cfg.fault.inject[0], "b@step=2,rank=1");
  EXPECT_EQ(cfg.fault.inject[1], "c@step=3,rank=0");
}

TEST(ConfigOverrides, BadValuesNameTheOption) {
  Config cfg;
  try {
    keel::apply_override(cfg, "train.batch_size", "0");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--train.batch_size"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
  }
  EXPECT_THROW(keel::apply_override(cfg, "train.steps", "12x"), InputError);
  EXPECT_THROW(keel::apply_override(cfg, "train.lr", "fast"), InputError);
  EXPECT_THROW(keel::apply_override(cfg, "data.drop_last", "maybe"), InputError);
  EXPECT_THROW(keel::apply_override(cfg, "train.nope", "1"), InputError);
}

TEST(ConfigDump, RoundTripsEveryKey) {
  Config a;
  keel::apply_override(a, "train.lr", "0.0003");
  keel::apply_override(a, "run.name", "quote\"and\\slash");
  keel::apply_override(a, "dist.bucket_cap_mb", "0.1");
  keel::validate(a);
  const std::string text = keel::dump_toml(a);
  Config b;
  keel::load_toml_string(text, "dump.toml", b);
  for (const auto& f : keel::config_schema())
    EXPECT_EQ(keel::to_toml_literal(f.get(a)), keel::to_toml_literal(f.get(b))) << f.dotted();
}

TEST(ConfigSchema, EveryContractKeyExists) {
  for (const char* k : {"run.name",
                        "run.dir",
                        "run.seed",
                        "run.threads",
                        "model.name",
                        "model.path",
                        "data.name",
                        "data.path",
                        "data.drop_last",
                        "train.steps",
                        "train.epochs",
                        "train.batch_size",
                        "train.grad_accum",
                        "train.optimizer",
                        "train.lr",
                        "train.weight_decay",
                        "train.warmup_steps",
                        "train.schedule",
                        "train.grad_clip",
                        "train.eval_interval",
                        "dist.timeout_s",
                        "dist.backend",
                        "dist.bucket_cap_mb",
                        "dist.find_unused_parameters",
                        "dist.comm_hook",
                        "dist.validate",
                        "compile.mode",
                        "compile.fullgraph",
                        "compile.deterministic",
                        "compile.max_recompiles",
                        "compile.cache_dir",
                        "compile.cuda_graphs",
                        "amp.dtype",
                        "amp.loss_scaling",
                        "checkpoint.dir",
                        "checkpoint.interval",
                        "checkpoint.keep",
                        "checkpoint.async",
                        "checkpoint.resume_from",
                        "checkpoint.save_graph",
                        "fault.inject",
                        "train.skip_nonfinite"})
    EXPECT_NE(keel::find_field(k), nullptr) << k;
}

}  // namespace
