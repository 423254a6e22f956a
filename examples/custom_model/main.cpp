// A custom C++ model and dataset trained by keel's Trainer, as a user's own binary.
// Run alone, or on 2 ranks:
//   torchrun --standalone --nproc_per_node 2 --no_python ./custom_model
#include <trainer/config.h>
#include <trainer/data.h>
#include <trainer/trainer.h>

#include <csignal>
#include <iostream>

namespace {

// y = sign of a fixed linear function of 16 features: learnable by a tiny MLP.
class Blobs : public keel::data::Dataset {
 public:
  Blobs(int64_t n, uint64_t seed) {
    auto g = at::detail::createCPUGenerator(seed);
    x_ = torch::randn({n, 16}, g);
    y_ = (x_.sum(1) > 0).to(torch::kLong);
  }
  int64_t size() const override { return x_.size(0); }
  keel::data::Batch get(const std::vector<int64_t>& idx) const override {
    auto i = torch::tensor(idx, torch::kLong);
    return {x_.index_select(0, i), y_.index_select(0, i)};
  }

 private:
  torch::Tensor x_, y_;
};

struct TinyImpl : torch::nn::Module {
  TinyImpl() : fc1(register_module("fc1", torch::nn::Linear(16, 32))), fc2(register_module("fc2", torch::nn::Linear(32, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Tiny);

}  // namespace

int main() {
  std::signal(SIGPIPE, SIG_IGN);  // as every PyTorch process: a gone peer is an error, not a silent death
  const keel::models::InputSpec spec{keel::models::InputKind::Image, {16}, 2};
  keel::models::register_model("tiny", [spec](const keel::ModelConfig&, std::optional<keel::models::InputKind>) {
    return std::make_shared<keel::models::ModuleModel<Tiny>>("tiny", Tiny(), spec);
  });
  keel::data::register_dataset("blobs", [](const keel::DataConfig&, const keel::models::InputSpec&, int64_t seed) {
    return keel::data::Splits{std::make_shared<Blobs>(2048, seed), std::make_shared<Blobs>(512, seed + 1)};
  });

  keel::Config cfg;
  cfg.run.name = "custom_model";
  cfg.run.dir = "runs/custom_model";
  cfg.model.name = "tiny";
  cfg.data.name = "blobs";
  cfg.train.steps = 100;
  cfg.train.batch_size = 32;
  cfg.train.lr = 1e-2;
  cfg.train.eval_interval = 100;
  cfg.checkpoint.dir = "runs/custom_model/ckpt";  // run it again: it resumes from step 100
  cfg.checkpoint.interval = 50;
  keel::validate(cfg);

  int64_t evals_seen = 0;  // your own state: it travels in keel's checkpoints
  keel::Callbacks cb;
  cb.on_eval = [&](const keel::EvalResult& r) {
    ++evals_seen;
    std::cout << "eval: accuracy " << r.accuracy << "\n";
  };
  cb.save_state = [&](keel::checkpoint::State& st) { st.shared["user"] = {{"evals_seen", evals_seen}}; };
  cb.load_state = [&](const keel::checkpoint::State& st) {
    evals_seen = st.shared.value("user", nlohmann::json::object()).value("evals_seen", int64_t{0});
  };
  cb.on_checkpoint = [](int64_t step, const std::string& dir) { std::cout << "checkpoint " << step << ": " << dir << "\n"; };
  auto world = keel::dist::detect_world(keel::dist::current_env());
  auto summary = keel::Trainer(cfg, world, cb).run();
  std::cout << "world " << summary["world_size"] << ", final loss " << summary["final_loss"] << "\n";
  return summary.value("test_accuracy", 0.0) > 0.9 ? 0 : 1;
}
