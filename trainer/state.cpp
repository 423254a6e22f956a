#include "trainer/state.h"

#include "keel/dist/collectives.h"

#include <mutex>
#include <set>

#include "common/file.h"
#include "common/log.h"
#include "common/sha256.h"
#include "dist/sharded_parameters.h"
#include "keel/common/error.h"
#include "trainer/compile/inductor.h"

namespace keel {

checkpoint::NamedTensors ModelState::tensors() const {
  checkpoint::NamedTensors t;
  for (const auto& [n, x] : model_->named_parameters()) t.emplace_back(n, x);
  for (const auto& [n, x] : model_->named_buffers()) t.emplace_back(n, x);
  return t;
}

void ModelState::save(checkpoint::Component& mine) const {
  if (!hf_config_.is_null()) mine.values["hf_config"] = hf_config_;
  if (!sharded_) {
    for (auto& [n, t] : tensors()) mine.add(n, t);
    return;
  }
  for (auto& [n, t] : sharded_->whole_owned_parameters()) mine.add(n, t, checkpoint::Placement::Owned);
  for (const auto& [n, t] : model_->named_buffers()) mine.add(n, t);
}

void ModelState::load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  try {
    if (!sharded_) return checkpoint::copy_into(tensors(), mine.tensors, loaded.path);
    // The step against the model's shapes (on the meta device: nothing is copied), then each
    // rank's pieces from the whole parameters read, and the buffers.
    checkpoint::NamedTensors shapes = sharded_->parameter_shapes(), saved, buffers, saved_buffers;
    std::set<std::string> is_buffer;
    for (const auto& [n, t] : model_->named_buffers()) {
      shapes.emplace_back(n, t.to(torch::kMeta));
      buffers.emplace_back(n, t);
      is_buffer.insert(n);
    }
    for (const auto& [n, t] : mine.tensors) {
      saved.emplace_back(n, t.to(torch::kMeta));
      if (is_buffer.count(n)) saved_buffers.emplace_back(n, t);
    }
    checkpoint::copy_into(shapes, saved, loaded.path);
    checkpoint::copy_into(buffers, saved_buffers, loaded.path);
    sharded_->load_pieces(mine.tensors);
  } catch (const checkpoint::BindError& e) {
    throw InputError(e.what());
  }
}

namespace {

std::vector<torch::Device> rng_devices(const torch::Device& device) {
  std::vector<torch::Device> d{torch::kCPU};
  if (device.is_cuda()) d.push_back(device);
  return d;
}

}  // namespace

void RngState::save(checkpoint::Component& mine) const {
  for (const auto& d : rng_devices(device_)) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    mine.add("rng." + d.str(), gen.get_state(), checkpoint::Placement::PerRank);
  }
}

void RngState::load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  if (!loaded.has_rank_state) return;
  for (const auto& d : rng_devices(device_))
    for (const auto& [name, t] : mine.rank_tensors)
      if (name == "rng." + d.str()) {
        auto gen = at::globalContext().defaultGenerator(d);
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(t);
      }
}

void share_generators(const torch::Device& device, dist::Collectives& group) {
  if (group.size() == 1) return;
  for (const auto& d : rng_devices(device)) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    torch::Tensor state = gen.get_state().clone();
    group.broadcast(state, 0, "tp: generator state after a resume");
    gen.set_state(state);
  }
}

std::string RngState::check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const {
  if (!loaded.has_rank_state) return "";
  for (const auto& d : rng_devices(device_))
    for (const auto& [name, t] : mine.rank_tensors)
      if (name == "rng." + d.str()) {
        // A clone of the generator takes the state first: what the real one would refuse, or
        // throw on, is found here without touching it.
        at::Generator probe;
        torch::Tensor current;
        {
          auto gen = at::globalContext().defaultGenerator(d);
          std::lock_guard<std::mutex> lock(gen.mutex());
          current = gen.get_state();
          probe = gen.clone();
        }
        if (t.scalar_type() != current.scalar_type() || t.sizes() != current.sizes())
          return name + ": " + c10::toString(t.scalar_type()) + c10::str(t.sizes()) + " is not a generator state (" +
                 c10::toString(current.scalar_type()) + c10::str(current.sizes()) + ")";
        try {
          probe.set_state(t);
        } catch (const c10::Error& e) {
          const std::string what = e.what_without_backtrace();
          return name + ": not a valid generator state: " + what.substr(0, what.find('\n'));
        }
      }
  return "";
}

void GraphState::save(checkpoint::Component& mine) const {
  std::string graph = export_();
  if (graph.empty()) {
    if (warn_)
      logging::warn("checkpoint.save_graph: the model is not traced (compile fell back to eager); no graph.pt");
    return;
  }
  mine.files["graph.pt"] = std::move(graph);
  mine.values["files"] = {{"graph.pt", "the traced TorchScript module"}};
}

void PackageState::save(checkpoint::Component& mine) const {
  if (!main_) return;
  if (!package_) {
    logging::warn("checkpoint.save_graph: the training step runs eager (no package); no graph.pt2");
    return;
  }
  // Rank 0 alone runs this: a failure must not stop it (the other ranks would wait in the save's
  // collectives), so it is a warning and a step without the package.
  if (unusable_) return;
  if (bytes_.empty()) {
    try {
      std::string bytes = read_regular_file(package_->path, uint64_t{16} << 30);
      if (sha256_hex(bytes) != package_->sha256)  // the cache entry was replaced under this run
        throw std::runtime_error("it changed since this run loaded it (SHA-256 differs)");
      bytes_ = std::move(bytes);
    } catch (const std::exception& e) {
      logging::warn("checkpoint.save_graph: cannot store {}: {}; the steps of this run have no graph.pt2",
                    package_->path, e.what());
      unusable_ = true;
      return;
    }
  }
  mine.files["graph.pt2"] = bytes_;
  mine.files["graph.json"] = package_->manifest;
  mine.values["files"] = {{"graph.pt2", "the AOTInductor package of " + package_->what},
                          {"graph.json", "its manifest"}};
}

}  // namespace keel
