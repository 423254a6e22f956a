// keel_comm_bench: what communication costs on this machine, through keel's own dist/ layer.
// Run as N ranks with torchrun's environment (bench/bench.py does it):
//   RANK=.. WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=.. build/keel_comm_bench [--iters N]
// Prints one JSON line per measurement (rank 0): raw Gloo all-reduce time for the gradient
// sizes of keel's models, the validated vs unvalidated tiny all-reduce, and the per-step
// consensus. Checks each all-reduce's result before timing it.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "keel/models/model.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

template <class F>
double time_ms(int iters, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 50;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--iters") iters = std::stoi(argv[i + 1]);
  at::set_num_threads(1);
  auto world = keel::dist::detect_world(keel::dist::current_env());
  keel::DistConfig cfg;
  auto group = keel::dist::Group::create(world, cfg, torch::kCPU);
  keel::dist::Collectives validated(group, keel::Validate::Always), plain(group, keel::Validate::Off);
  auto emit = [&](nlohmann::json j) {
    j["world"] = world.size;
    if (world.rank == 0) std::printf("%s\n", j.dump().c_str());
  };

  for (const char* name : {"mlp", "cnn", "gpt"}) {
    keel::ModelConfig mc;
    mc.name = name;
    const int64_t n = keel::models::create_model(mc)->num_parameters();
    auto t = torch::full({n}, double(world.rank + 1), torch::kFloat);
    plain.all_reduce(t);
    const float want = world.size * (world.size + 1) / 2.0f;
    if (t[0].item<float>() != want || t[n - 1].item<float>() != want) {
      std::fprintf(stderr, "all_reduce result wrong\n");
      return 1;
    }
    const double ms = time_ms(iters, [&] { plain.all_reduce(t); });
    emit({{"measure", "gloo_allreduce_gradients"},
          {"model", name},
          {"bytes", n * 4},
          {"median_ms", ms},
          {"algbw_GBps", n * 4 / ms / 1e6}});
  }
  auto tiny = torch::zeros({2}, torch::kLong);
  emit({{"measure", "allreduce_16B_unvalidated"}, {"median_ms", time_ms(iters * 4, [&] { plain.all_reduce(tiny); })}});
  emit(
      {{"measure", "allreduce_16B_validated"}, {"median_ms", time_ms(iters * 4, [&] { validated.all_reduce(tiny); })}});
  int64_t step = 0;
  emit({{"measure", "step_consensus"},
        {"median_ms", time_ms(iters * 4, [&] { plain.step_sync(++step, 42, 1.0, false, 1.0); })}});
  return 0;
}
