// keel/checkpoint/checkpoint.h: sharded, atomic, checksummed checkpoints: what a step holds, how
// to read one, and the Checkpointer that saves and loads them with async save and resume
// (checkpoint/checkpointer.h, private: file names, the shard plan, the protocol).
//
// A step's state is a map of named components (the trainer's are model, optimizer, progress,
// grad_scaler, rng, sampler, graph and user); the checkpointer knows none of them. Each
// component holds tensors, each tagged with its Placement (replicated, owned by this rank,
// or per rank), small JSON values, and whole files. Layout of checkpoint.dir (one directory
// per step, N = optimizer steps done; <c> a component with tensors, W the saving world):
//   step_<N>/<c>-0000r-of-0000W.safetensors    rank r's file of component <c>: its share of the
//                                               replicated tensors (balanced over the ranks,
//                                               largest first) and every tensor it owns
//   step_<N>/<c>.safetensors.index.json        weight_map (each tensor -> its file) and
//                                               metadata.total_size: Hugging Face's index, so
//                                               step_<N>/model.safetensors.index.json opens
//                                               the model in transformers and safetensors
//   step_<N>/rank-0000r.safetensors            rank r's PerRank tensors ("rank.<r>.<c>.<name>")
//                                               and, in its metadata, each component's rank_values
//   step_<N>/<file>                            a component's whole files (rank 0's), e.g. the
//                                               traced graph.pt or the AOTInductor graph.pt2
//   step_<N>/meta.json                         written last: the commit marker
// meta.json (format_version 2) holds the step, world size, the resolved config's SHA-256, keel
// and LibTorch versions, and per component ("components": {<c>: ...}) its values, the dtype
// and shape of each of its tensors (every rank checks what it reads against them, and that the
// index lists exactly them), its owned tensors' names and its files; then the size and SHA-256
// of every file. Steps of format_version 1 (keel 0.1: fixed slots model / optimizer / extra /
// shared) still load: see Loaded::component.
//
// A library user reads a checkpoint with list_steps / resume_from_dir (which step), verify_step
// (are its files whole) and load_weights (a step's, or any safetensors export's, weights into a
// model); Callbacks::save_state / load_state (keel/trainer/trainer.h) add a component of their
// own ("user") to the trainer's, and a loop of one's own saves and loads with a Checkpointer.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace keel::dist {
class Collectives;
}
namespace keel::models {
class Model;
}

namespace keel::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// A save failed on some rank; thrown on every rank. The previous checkpoint is intact.
/// checkpoint.resume_from names a step that is not there or does not load: the user's input.
class ResumeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class SaveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Where a tensor of a checkpoint lives across the ranks: who writes it, who reads it back.
enum class Placement {
  /// The same on every rank (checked at save by name, dtype and size): written once, the ranks
  /// sharing the writing; read by every rank.
  Replicated,
  /// This rank's alone (a partition of optimizer state, a shard of parameters): written by this
  /// rank; the component's index says which file holds it, so that a rank of a later job reads
  /// only the files holding what it wants (Options::wants). No two ranks own the same name.
  Owned,
  /// Every rank its own value under the same name (a random generator's state): written to the
  /// rank's own file, handed back to the rank of the same number when the saving job had it
  /// (Loaded::has_rank_state); what a job of another world size makes of it is the component's.
  PerRank,
};

/// One component's part of a step (what Stateful::save fills in).
struct Component {
  struct Entry {
    std::string name;
    torch::Tensor tensor;
    Placement placement = Placement::Replicated;
  };
  std::vector<Entry> tensors;  // names unique within the component
  /// Small values, the same on every rank (rank 0's are written): meta.json
  /// components.<name>.values.
  nlohmann::json values = nlohmann::json::object();
  /// This rank's own small values: its rank file.
  nlohmann::json rank_values = nlohmann::json::object();
  /// Whole files of the step, written by rank 0 (name -> contents), e.g. "graph.pt": plain names
  /// that are not the step's own (meta.json, rank-*, *.safetensors, *.safetensors.index.json).
  std::map<std::string, std::string> files;

  void add(std::string name, torch::Tensor tensor, Placement placement = Placement::Replicated) {
    tensors.push_back({std::move(name), std::move(tensor), placement});
  }
  /// The tensors of one placement, in order.
  NamedTensors named(Placement placement) const {
    NamedTensors out;
    for (const auto& e : tensors)
      if (e.placement == placement) out.emplace_back(e.name, e.tensor);
    return out;
  }
};

/// Everything one step saves: components by name ([a-z0-9_], at most 64 characters; the same
/// set, with the same replicated tensors, on every rank).
struct State {
  std::map<std::string, Component> components;
  Component& operator[](const std::string& name) { return components[name]; }
};

/// One component's part of a loaded step.
struct LoadedComponent {
  bool present = false;  // the step has this component
  /// Its replicated and owned tensors that this rank read: all of them, or those
  /// Options::wants asked for.
  NamedTensors tensors;
  /// This rank's PerRank tensors (when Loaded::has_rank_state).
  NamedTensors rank_tensors;
  nlohmann::json values = nlohmann::json::object();
  nlohmann::json rank_values = nlohmann::json::object();  // this rank's (when Loaded::has_rank_state)
  /// Every replicated and owned tensor of the step's component (not only those read) -> the
  /// file holding it; with its dtype ("F32", safetensors' names) and shape where the step records them.
  std::map<std::string, std::string> index;
  struct Shape {
    std::string dtype;
    std::vector<int64_t> shape;
  };
  std::map<std::string, Shape> shapes;       // format_version >= 2
  std::map<std::string, std::string> files;  // its whole files: name -> path in the step directory
};

/// What load() found.
struct Loaded {
  int64_t step = 0;
  std::string path;  // the step directory
  int64_t saved_world_size = 0;
  int64_t format_version = 2;
  nlohmann::json meta;
  bool has_rank_state = false;  // the saving job had this rank: rank tensors and values are its own
  std::map<std::string, LoadedComponent> components;
  /// Tensor files of each component that this rank read and verified (the others it checked
  /// for presence and size only).
  std::map<std::string, int64_t> files_read;

  /// The component `name` (present = false and empty when the step has none). A step of
  /// format_version 1 had fixed slots: its tensor files (model-, optimizer-, extra-) are the
  /// components of those names; and every component sees all of its small values
  /// (meta.json "state", with the top-level object named like the component merged in, e.g.
  /// "optimizer"), the rank file's values, and its rank tensors by their old names.
  LoadedComponent component(const std::string& name) const;

  // format_version 1's shared slots (component() hands them to every component).
  nlohmann::json legacy_values = nlohmann::json::object();
  nlohmann::json legacy_rank_values = nlohmann::json::object();
  NamedTensors legacy_rank_tensors;
  std::map<std::string, std::string> legacy_files;  // its whole files (graph.pt, ...): name -> path
};

/// One step directory as seen by list_steps / inspect.
struct StepInfo {
  int64_t step = 0;
  std::string path;
  bool committed = false;  // meta.json present and parseable
};

/// The step directory `checkpoint.resume_from` names: a step number (step_<N> under `dir`), a
/// directory, or a name under `dir`. Throws ResumeError for a number that is too large.
std::string resume_from_dir(const std::string& dir, const std::string& resume_from);

/// Step directories under `dir`, oldest first.
std::vector<StepInfo> list_steps(const std::string& dir);

/// Verifies every file listed in `step_dir`/meta.json against its recorded size and SHA-256.
/// Returns the problems found (empty: the step verifies).
std::vector<std::string> verify_step(const std::string& step_dir);

/// Seams where tests and fault injection (trainer/fault/) step in; production runs set none.
struct Hooks {
  /// Before each write to one of this rank's files of step `step` (on the writer thread):
  /// `file` is its name in the step directory, `offset` the bytes already written. A non-zero
  /// return is the errno that write fails with (a full or failing disk).
  std::function<int(int64_t step, const std::string& file, uint64_t offset)> before_write;
  /// After step `step` is committed and old steps are cleaned up, on every rank.
  std::function<void(int64_t step, const std::string& step_dir)> after_commit;
};

struct Options {
  std::string dir;   // checkpoint.dir
  int64_t keep = 3;  // committed steps kept
  bool async = false;
  std::string config_sha256;  // the resolved config's hash, recorded in meta.json
  Hooks hooks;
  /// Which of a component's replicated and owned tensors this rank loads; empty = all of them.
  /// Only the files holding a wanted tensor are read and verified on this rank (the others are
  /// checked for presence and size).
  std::function<bool(const std::string& component, const std::string& name)> wants;
};

class Checkpointer {
 public:
  Checkpointer(Options opts, std::shared_ptr<dist::Collectives> coll);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Collective. Saves `state` as step `step`: synchronously (returns after the commit), or
  /// with async, copies it to CPU and returns while a background thread writes. Waits for
  /// (and commits) a previous async save first. Throws SaveError on every rank on failure.
  void save(int64_t step, const State& state);
  /// Whether this rank's background write has finished (true when none is pending).
  bool write_finished() const;
  /// Whether a save is written but not yet committed.
  bool pending() const { return pending_step_ >= 0; }
  /// Collective: waits for this rank's write and commits the pending save (no-op if none).
  void commit();
  /// Collective: commit() and stop.
  void finish() { commit(); }
  /// The newest committed step, or -1.
  int64_t last_committed() const { return last_committed_; }

  /// Collective. Loads the newest committed step that verifies on every rank (or exactly
  /// `resume_from`, a step directory or step number, when non-empty). nullopt when there is
  /// none. Throws ResumeError when `resume_from` does not load; a failure of the collectives
  /// (a peer died) is a dist::CollectiveError, never a ResumeError.
  /// `validate` (may be empty) checks the values of a step that verified, on every rank (e.g.
  /// StateRegistry::check); a problem on any rank counts as a failed verification.
  std::optional<Loaded> load(const std::string& resume_from = "",
                             const std::function<std::string(const Loaded&)>& validate = {});

  /// Milliseconds the last save() blocked the caller (the async stall).
  double last_save_blocking_ms() const { return last_blocking_ms_; }
  /// Milliseconds the last background write took.
  double last_write_ms() const;

 private:
  struct Pending;
  void write_shards(Pending& p);
  std::string step_dir(int64_t step) const;
  void cleanup(int64_t keep_step);
  void set_aside(const std::vector<std::string>& steps);

  Options opts_;
  std::shared_ptr<dist::Collectives> coll_;
  int64_t rank_ = 0, world_ = 1;
  std::unique_ptr<Pending> pending_;
  int64_t pending_step_ = -1;
  int64_t last_committed_ = -1;
  std::map<std::string, torch::Tensor> staging_;  // async snapshot buffers, reused
  double last_blocking_ms_ = 0;
  double last_write_ms_ = 0;
};

/// The checkpoint's tensors do not bind to the model; the message lists the missing,
/// unexpected and mismatched entries.
class BindError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Copies `source` into `targets` (in place, without autograd), requiring the names, shapes and
/// dtypes to match exactly; otherwise throws BindError listing every missing, unexpected and
/// mismatched entry. `what` names the source in the message (e.g. the step directory).
void copy_into(const NamedTensors& targets, const NamedTensors& source, const std::string& what);

/// Copies the weights at `path` into `model`'s parameters and buffers (on their device): a
/// .safetensors file written by anyone (PyTorch's `safetensors.torch.save_file`), a Hugging Face
/// sharded export (model.safetensors.index.json), or a keel checkpoint step (which has that
/// index); a directory holding the index or a single model.safetensors. The match of names and
/// shapes is strict, as torch.nn.Module.load_state_dict(strict=True): every parameter and buffer
/// must be there with its shape, and a tensor the model lacks is an error too; floating dtypes
/// convert. Returns the number of tensors loaded. Throws InputError naming the file and the
/// tensor for anything that does not match or cannot be read. (model.init_from; resuming a run
/// restores the optimizer, data position and RNG as well.)
int64_t load_weights(models::Model& model, const std::string& path);

}  // namespace keel::checkpoint
