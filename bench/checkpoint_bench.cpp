// keel_checkpoint_bench: checkpoint save/load throughput and the async stall, through keel's
// own checkpoint/ layer. bench/checkpoint_bench.py runs it next to dd (the disk's own speed)
// and torch.save/torch.load (PyTorch) on the same bytes and prints the ratios.
//   build/keel_checkpoint_bench --dir DIR [--mb 384] [--repeat 3]
// Also runs as N ranks with torchrun's environment (each rank writes its shard).
// Prints one JSON line (rank 0). The state is an AdamW-like layout: model tensors of mb/3 MB in
// total and two optimizer tensors per model tensor.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpointer.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int64_t mb = 384;
  int repeat = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir")
      dir = argv[i + 1];
    else if (a == "--mb")
      mb = std::stoll(argv[i + 1]);
    else if (a == "--repeat")
      repeat = std::stoi(argv[i + 1]);
  }
  if (dir.empty()) {
    std::fprintf(stderr, "usage: keel_checkpoint_bench --dir DIR [--mb 384] [--repeat 3]\n");
    return 2;
  }
  using namespace keel;
  const dist::World world = dist::detect_world(dist::current_env());
  auto coll = std::make_shared<dist::Collectives>(dist::Group::create(world, DistConfig{}, torch::kCPU),
                                                  keel::Validate::Always);

  checkpoint::State st;
  const int64_t n_tensors = 24;
  const int64_t per = std::max<int64_t>(1, mb * (1 << 20) / 3 / n_tensors / 4);  // floats per model tensor
  torch::manual_seed(0);
  for (int64_t i = 0; i < n_tensors; ++i) {
    const std::string name = "layer." + std::to_string(i) + ".weight";
    st["model"].add(name, torch::randn({per}));
    st["optimizer"].add(name + ".exp_avg", torch::randn({per}));
    st["optimizer"].add(name + ".exp_avg_sq", torch::rand({per}));
  }
  st["rng"].add("rng.cpu", torch::arange(5056, torch::kByte), checkpoint::Placement::PerRank);
  const double bytes = 3.0 * n_tensors * per * 4;

  checkpoint::Options o;
  o.dir = dir + "/sync";
  o.keep = 2;
  std::vector<double> save_ms, load_ms, block_ms, write_ms, write_ms_sync;
  {
    checkpoint::Checkpointer c(o, coll);
    for (int r = 0; r < repeat; ++r) {
      auto t0 = Clock::now();
      c.save(r + 1, st);
      save_ms.push_back(ms_since(t0));
      write_ms_sync.push_back(c.last_write_ms());
    }
  }
  for (int r = 0; r < repeat; ++r) {
    checkpoint::Checkpointer c(o, coll);
    auto t0 = Clock::now();
    auto L = c.load();
    load_ms.push_back(ms_since(t0));
    if (!L || L->component("model").tensors.size() != st["model"].tensors.size()) {
      std::fprintf(stderr, "load failed\n");
      return 1;
    }
  }
  o.dir = dir + "/async";
  o.async = true;
  {
    checkpoint::Checkpointer c(o, coll);
    for (int r = 0; r < repeat; ++r) {
      c.save(r + 1, st);  // returns after the snapshot; the previous save was committed below
      block_ms.push_back(c.last_save_blocking_ms());
      // "Training" goes on until every rank's writer is done, then the commit (as in the trainer).
      while (!c.write_finished()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      c.commit();
      write_ms.push_back(c.last_write_ms());
    }
  }
  if (world.rank == 0) {
    const double s = median(save_ms), l = median(load_ms), b = median(block_ms);
    nlohmann::json j = {{"bench", "checkpoint"},
                        {"world_size", world.size},
                        {"bytes", bytes},
                        {"sync_save_ms", s},
                        {"sync_save_MBps", bytes / 1e3 / s},
                        {"sync_write_ms_rank0", median(write_ms_sync)},
                        {"load_ms", l},
                        {"load_MBps", bytes / 1e3 / l},
                        {"async_blocking_ms", b},
                        {"async_write_ms", median(write_ms)},
                        {"async_stall_vs_sync", b / s},
                        {"repeat", repeat}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}
