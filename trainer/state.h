// trainer/state.h: the trainer's own pieces of a checkpoint, as checkpoint::Stateful
// components (the others are the optimizer's, trainer/optim.h; the GradScaler's,
// amp/grad_scaler.h; and the sampler's, trainer/data/sampler.h).
//
// Owns: the model's tensors (component "model", replicated; at dist.zero = 3 and with tensor
// parallelism each parameter whole, owned by the rank that writes it), this rank's random generators
// (component "rng", per rank: "rng.<device>"), the traced graph or package (component "graph",
// checkpoint.save_graph), and the user's own state (component "user",
// Callbacks::save_state / load_state).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint/stateful.h"
#include "keel/models/model.h"
#include "trainer/compile/inductor.h"

namespace keel::dist {
class Collectives;
class ShardedParameters;
}  // namespace keel::dist

namespace keel {

/// Parameters and buffers, by name. Loading requires every name, shape and dtype to match and
/// throws InputError listing the differences (the user chose a checkpoint of another model).
class ModelState : public checkpoint::Stateful {
 public:
  /// `hf_config` (may be null): the Hugging Face config.json of a gpt2 or llama model
  /// (models/hf.h), recorded in its values as hf_config so that `keel export --hf` can
  /// describe the step's weights to transformers.
  /// `sharded` (dist.zero = 3 or tensor parallelism, else null): the model's parameters are split
  /// between ranks (dist/sharded_parameters.h); each rank then writes the whole parameters it
  /// owns, the buffers as usual, and a load takes each rank's parts from the parameters read, so
  /// that the step holds the same whole tensors as an unsplit run's.
  explicit ModelState(std::shared_ptr<models::Model> model, nlohmann::json hf_config = nullptr,
                      dist::ShardedParameters* sharded = nullptr)
      : model_(std::move(model)), hf_config_(std::move(hf_config)), sharded_(sharded) {}
  void save(checkpoint::Component& mine) const override;
  void load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) override;
  /// A step without the model's tensors is unusable (a fallback), not another model (exit 2).
  std::string check(const checkpoint::Loaded&, const checkpoint::LoadedComponent& mine) const override {
    return mine.present && !mine.index.empty() ? "" : "the step has no model tensors (no model component)";
  }

 private:
  checkpoint::NamedTensors tensors() const;
  std::shared_ptr<models::Model> model_;
  nlohmann::json hf_config_;
  dist::ShardedParameters* sharded_ = nullptr;
};

/// The generators a step draws from: the CPU one always, the device's one on CUDA. Saved per
/// rank (each rank's dropout masks differ once ranks draw different amounts); restored only
/// when the saved job had this rank. Under tensor parallelism the ranks of a tp group must draw
/// alike (their shared dropout masks): share_generators() after the load.
class RngState : public checkpoint::Stateful {
 public:
  explicit RngState(torch::Device device) : device_(device) {}
  void save(checkpoint::Component& mine) const override;
  void load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) override;
  /// Each saved generator state has the dtype and size of this build's generator state.
  std::string check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const override;

 private:
  torch::Device device_;
};

/// Collective over `group` (the tp axis after a resume): every rank takes its first rank's
/// generator states (the CPU one; the device's on CUDA). Issue 64: a step saved by fewer ranks,
/// resumed at tp 2, restored rank 0's saved state while rank 1 started from run.seed, and the tp
/// ranks' dropout masks parted silently.
void share_generators(const torch::Device& device, dist::Collectives& group);

/// checkpoint.save_graph: the traced module as graph.pt (saved, never loaded: it is for
/// deployment). `export_graph` returns "" for an eager model.
class GraphState : public checkpoint::Stateful {
 public:
  GraphState(std::function<std::string()> export_graph, bool warn) : export_(std::move(export_graph)), warn_(warn) {}
  void save(checkpoint::Component& mine) const override;
  void load(const checkpoint::Loaded&, const checkpoint::LoadedComponent&) override {}

 private:
  std::function<std::string()> export_;
  bool warn_;
};

/// checkpoint.save_graph with compile.mode = "inductor": rank 0 stores the loaded AOTInductor
/// package (graph.pt2) and its manifest with the cache key (graph.json) with every step. Loaded
/// through the compile cache, not here (InductorRequest::seed_dir). `step` is null when the
/// training step runs eager (a warning then, once per save).
class PackageState : public checkpoint::Stateful {
 public:
  PackageState(std::optional<PackageFiles> package, bool main) : package_(std::move(package)), main_(main) {}
  void save(checkpoint::Component& mine) const override;
  void load(const checkpoint::Loaded&, const checkpoint::LoadedComponent&) override {}

 private:
  std::optional<PackageFiles> package_;
  bool main_;
  mutable std::string bytes_;  // the package, read and verified once (it never changes in a run)
  mutable bool unusable_ = false;
};

/// The user's Callbacks::save_state / load_state: the component "user". A step of format 1
/// kept the user's tensors in its "extra" files: they are handed over as the user's.
class UserState : public checkpoint::Stateful {
 public:
  UserState(std::function<void(checkpoint::Component&)> save,
            std::function<void(const checkpoint::LoadedComponent&)> load)
      : save_(std::move(save)), load_(std::move(load)) {}
  void save(checkpoint::Component& mine) const override {
    if (save_) save_(mine);
  }
  void load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) override {
    if (!load_) return;
    if (loaded.format_version >= 2) return load_(mine);
    checkpoint::LoadedComponent old = mine;
    old.tensors = loaded.component("extra").tensors;
    load_(old);
  }

 private:
  std::function<void(checkpoint::Component&)> save_;
  std::function<void(const checkpoint::LoadedComponent&)> load_;
};

}  // namespace keel
