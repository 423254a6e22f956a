// A user's own model, dataset, loss, optimizer and learning-rate schedule trained by keel's Trainer, as a
// user's own binary: a small regression network (no classes, mean squared error), each part
// registered by name as keel's built-ins are (so a config file could choose them), with its own
// state carried in keel's checkpoints. Run alone, or on 2 ranks:
//   torchrun --standalone --nproc_per_node 2 --no_python ./custom_model
// Any config key can be set on the command line, as with keel's own binary, e.g. the compile stage,
// which traces this very C++ model and loss into one AOTInductor package, or one package of its
// block (reused for the three) and its root around them:
//   ./custom_model --compile.mode=inductor
//   ./custom_model --compile.mode=inductor --compile.granularity=blocks --dist.zero=3
#include <keel/common/error.h>
#include <keel/models/model.h>
#include <keel/trainer/config/config.h>
#include <keel/trainer/data/data.h>
#include <keel/trainer/trainer.h>

#include <cmath>
#include <csignal>
#include <iostream>

namespace {

// y = a fixed linear function of 16 features plus a little noise, shape (N, 1).
class Linear16 : public keel::data::Dataset {
 public:
  Linear16(int64_t n, uint64_t seed) {
    auto g = at::detail::createCPUGenerator(seed);
    auto w = torch::linspace(-1, 1, 16).unsqueeze(1);  // the same function for every split
    x_ = torch::randn({n, 16}, g);
    y_ = x_.matmul(w) + 0.01 * torch::randn({n, 1}, g);
  }
  int64_t size() const override { return x_.size(0); }
  keel::data::Batch get(const std::vector<int64_t>& idx) const override {
    auto i = torch::tensor(idx, torch::kLong);
    return {x_.index_select(0, i), y_.index_select(0, i)};
  }

 private:
  torch::Tensor x_, y_;  // (N, 16), (N, 1)
};

// Three residual blocks between an input and an output layer. The blocks are declared to keel
// (BlockStructure: their parameter prefixes, and each one called through block_call between
// block_enter and block_leave), so that dist.zero = 3 gathers each block's parameters just around
// it, and compile.granularity = "blocks" packages one block for all three; the parts around them
// go through root_call as functions of their input, so that they are packaged too.
struct RegressorImpl : torch::nn::Module, keel::models::BlockStructure {
  RegressorImpl()
      : fc_in(register_module("fc_in", torch::nn::Linear(16, 32))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        fc_out(register_module("fc_out", torch::nn::Linear(32, 1))) {
    for (int i = 0; i < 3; ++i) {
      blocks->push_back(torch::nn::Linear(32, 32));
      block_prefixes.push_back("blocks." + std::to_string(i) + ".");
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {  // (B, 16) -> (B, 1)
    auto h = root_call(RootPart::Embed, x, [this](const torch::Tensor& in) { return torch::relu(fc_in->forward(in)); });
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto* layer = blocks[i]->as<torch::nn::Linear>();
      const auto block = [layer](const torch::Tensor& t) { return t + torch::relu(layer->forward(t)); };
      h = block_leave(i, block_call(i, block, block_enter(i, h)));
    }
    return root_call(RootPart::Head, h, [this](const torch::Tensor& in) { return fc_out->forward(in); });
  }
  torch::nn::Linear fc_in;
  torch::nn::ModuleList blocks;
  torch::nn::Linear fc_out;
};
TORCH_MODULE(Regressor);

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // as every PyTorch process: a gone peer is an error, not a silent death
  const keel::models::InputSpec spec{keel::models::InputKind::Features, {16}, 1};
  keel::models::register_model("regressor", [spec](const keel::ModelConfig&, std::optional<keel::models::InputKind>) {
    return std::make_shared<keel::models::ModuleModel<Regressor>>("regressor", Regressor(), spec);
  });
  keel::data::register_dataset("linear16", [](const keel::DataConfig&, const keel::models::InputSpec&, int64_t seed) {
    return keel::data::Splits{std::make_shared<Linear16>(2048, seed), std::make_shared<Linear16>(512, seed + 1)};
  });
  keel::register_loss(
      "mse", [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); });
  // Step decay: the rate halves every 40 steps (after train.warmup_steps of linear warmup).
  keel::register_schedule("step_decay", [](int64_t step, int64_t, const keel::TrainConfig& t) {
    if (step < t.warmup_steps) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
    return t.lr * std::pow(0.5, static_cast<double>((step - t.warmup_steps) / 40));
  });

  // An optimizer of torch::optim's that keel does not build in, chosen by name (train.optimizer);
  // its state (Adam's step, exp_avg, exp_avg_sq per parameter) is checkpointed through its own
  // serialize() and partitioned with dist.zero like AdamW's.
  keel::register_optimizer<torch::optim::AdamParamState>(
      "adam", [](std::vector<torch::Tensor> params, const keel::TrainConfig& t) {
        return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(t.lr).betas({t.beta1, t.beta2}));
      });

  keel::Config cfg;
  cfg.run.name = "custom_model";
  cfg.run.dir = "runs/custom_model";
  cfg.model.name = "regressor";
  cfg.data.name = "linear16";
  cfg.train.steps = 100;
  cfg.train.batch_size = 32;
  cfg.train.lr = 1e-2;
  cfg.train.warmup_steps = 10;
  cfg.train.schedule = "step_decay";
  cfg.train.loss = "mse";
  cfg.train.optimizer = "adam";
  cfg.train.eval_interval = 100;
  cfg.checkpoint.dir = "runs/custom_model/ckpt";  // run it again: it resumes from step 100
  cfg.checkpoint.interval = 50;
  cfg.dist.zero = 1;                // each rank keeps the optimizer state of its own share of the parameters
  for (int i = 1; i < argc; ++i) {  // --section.key=value, as keel's own binary takes them
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::cerr << "usage: custom_model [--section.key=value ...] (got " << arg << ")\n";
      return 2;
    }
    try {
      keel::apply_override(cfg, arg.substr(2, eq - 2), arg.substr(eq + 1));
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";
      return 2;
    }
  }
  try {
    keel::validate(cfg);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }

  int64_t evals_seen = 0;  // your own state: it travels in keel's checkpoints
  keel::Callbacks cb;
  cb.on_eval = [&](const keel::EvalResult& r) {
    ++evals_seen;
    std::cout << "eval: mean squared error " << r.loss << "\n";
  };
  cb.save_state = [&](keel::checkpoint::Component& mine) { mine.values["evals_seen"] = evals_seen; };
  cb.load_state = [&](const keel::checkpoint::LoadedComponent& mine) {
    // A step of keel 0.1 (format 1) kept this under "user" in its shared values.
    const auto& v = mine.values.contains("user") ? mine.values["user"] : mine.values;
    evals_seen = v.value("evals_seen", int64_t{0});
  };
  cb.on_checkpoint = [](int64_t step, const std::string& dir) {
    std::cout << "checkpoint " << step << ": " << dir << "\n";
  };
  auto world = keel::dist::detect_world(keel::dist::current_env());
  keel::Summary summary;
  try {
    summary = keel::Trainer(cfg, world, cb).run();
  } catch (const keel::InputError& e) {  // bad input (config, data, a model the compile stage refuses)
    std::cerr << "custom_model: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "custom_model: " << e.what() << "\n";
    return 1;
  }
  std::cout << "world " << summary.world_size << ", final loss " << summary.final_loss << ", test loss "
            << summary.test_loss.value_or(NAN) << "\n";
  // The target's variance is about 6; a trained regressor is far below it (after the 100 steps
  // configured above: a shorter run given on the command line is not judged by its loss).
  return summary.test_loss.value_or(1e9) < 0.5 || cfg.train.steps < 100 ? 0 : 1;
}
