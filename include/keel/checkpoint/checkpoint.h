// keel/checkpoint/checkpoint.h: sharded, atomic, checksummed checkpoints: what a step holds, how
// to read one, and the Checkpointer that saves and loads them with async save and resume
// (checkpoint/checkpointer.h, private: file names, the shard plan, the protocol).
//
// Layout of checkpoint.dir (one directory per step, N = optimizer steps done):
//   step_<N>/model-0000r-of-0000W.safetensors     model tensors, sharded over the W ranks
//   step_<N>/model.safetensors.index.json         Hugging Face's index: weight_map, metadata.total_size
//   step_<N>/optimizer-0000r-of-0000W.safetensors optimizer state: sharded the same way when it
//                                                 is replicated (dist.zero = 0); rank r's own
//                                                 partition with dist.zero >= 1
//   step_<N>/optimizer.safetensors.index.json     weight_map: each optimizer state tensor -> its file
//   step_<N>/extra-0000r-of-0000W.safetensors     State::extra (a library user's own tensors), if any
//   step_<N>/rank-0000r.safetensors               rank r's own state (RNG states, data position)
//                                                 under keys "rank.<r>." and its metadata
//   step_<N>/graph.pt                             the traced module (checkpoint.save_graph, trace)
//   step_<N>/graph.pt2, graph.json                the AOTInductor package of the training step and
//                                                 its manifest (checkpoint.save_graph, inductor)
//   step_<N>/meta.json                            written last: the commit marker
// meta.json holds the step, world size, the resolved config's SHA-256, keel and LibTorch
// versions, the replicated trainer state (schedule position, loss scaler, counters), the
// optimizer state's partition ("optimizer": {"zero", "owners": {parameter: rank}}), and the
// size and SHA-256 of every other file.
//
//
// A library user reads a checkpoint with list_steps / resume_from_dir (which step), verify_step
// (are its files whole) and load_weights (a step's, or any safetensors export's, weights into a
// model); Callbacks::save_state / load_state (keel/trainer/trainer.h) add their own State to
// the trainer's, and a loop of one's own saves and loads with a Checkpointer.
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

/// Everything one step saves. `model`, `optimizer` and `shared` must be the same on every rank
/// (they are written once, sharded); `rank_tensors` and `rank_state` are this rank's own.
struct State {
  NamedTensors model;      // parameters and buffers, by name
  NamedTensors optimizer;  // optimizer state tensors, by name ("<parameter>.<field>")
  /// Empty: `optimizer` is replicated (the same on every rank). Otherwise (dist.zero >= 1) the
  /// owner rank of every parameter, the same on every rank, and `optimizer` holds this rank's
  /// own partition (the state of the parameters it owns), written by this rank alone.
  std::vector<std::pair<std::string, int64_t>> optimizer_owners;
  int64_t zero = 0;  // dist.zero, recorded in meta.json
  /// What the optimizer's state looks like, recorded in meta.json ("optimizer": "fields" and
  /// "state") so that every rank and `keel inspect` check a step's optimizer state before it is
  /// used: each per-parameter field and its kind ("scalar": one integer element in [0, step],
  /// a step count; "param": the parameter's shape and dtype), and every parameter the
  /// optimizer updates, of the whole model (with dist.zero >= 1 too, not only this rank's).
  /// A parameter has either every field or none (never stepped). Empty: not recorded.
  std::map<std::string, std::string> optimizer_fields;
  std::vector<std::string> optimizer_params;
  NamedTensors extra;                                // your own replicated tensors (sharded like the optimizer state)
  nlohmann::json shared = nlohmann::json::object();  // small replicated state (-> meta.json)
  NamedTensors rank_tensors;                         // e.g. RNG states (stored as "rank.<r>.<name>")
  nlohmann::json rank_state = nlohmann::json::object();  // e.g. the data position
  std::string graph;             // serialized TorchScript module (rank 0 writes it), may be empty
  std::string package;           // compile.mode = inductor: the step's .pt2 package (rank 0), may be empty
  std::string package_manifest;  // and its manifest (JSON: signature, SHA-256, compile cache key)
                                 // (loaded: their paths, not verified: see read_step)
};

/// What load() found.
struct Loaded {
  int64_t step = 0;
  std::string path;  // the step directory
  int64_t saved_world_size = 0;
  nlohmann::json meta;
  State state;  // rank_* hold this rank's own state when the step has it
  bool has_rank_state = false;
  int64_t optimizer_files_read = 0;  // of the saved world's optimizer files, those this rank read
  int64_t saved_zero = 0;            // meta.json "optimizer.zero" (0 when absent)
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
  /// Which optimizer state tensors this rank loads (by name); empty = all of them. Only the
  /// optimizer files holding a wanted tensor are read and verified on this rank.
  std::function<bool(const std::string& name)> wants_optimizer_tensor;
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
