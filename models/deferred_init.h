// models/deferred_init.h: sharded initialisation (model.sharded_init, issue 45 item 7): a model
// built so that no rank ever holds the whole of it, whose parameters still equal, bit for bit,
// what the unsharded build draws from the same run.seed.
//
// While a DeferredInit is in use on a thread (DeferredInit::Use, around the factory), a family
// hands each part of its model to defer_parameters() as soon as it is built (a block, then the
// rest): each parameter's memory is freed and it becomes a placeholder of its shape and dtype (one
// element of storage, expanded). The family's initialisation (init_normal_, init_fill_,
// init_edit_) is then recorded instead of done: a draw records the CPU generator's state and moves
// the generator on exactly as the draw would (a draw into a transient tensor of the parameter's
// whole shape, freed at once), so every later draw of the build, and of the run, is what it always
// was. The placements that shard a parameter say which part of it they keep (keep_part: the tp
// slice); value() makes only that part, replaying the recorded draws from their states on one
// transient whole tensor. model.init_from replaces the recipe by the file's tensor (from()),
// whose part is read from a mapping of the file.
//
// So a rank holds, at any time: its shards, plus one whole block while the family builds it (its
// layers' default initialisation draws, which the family overwrites, happen as built) and one
// whole parameter while a value is made (the largest, the token embedding, for a transformer).
//
// Owns: the recipes and parts of the deferred parameters of one model (by their TensorImpl, which
// set_data keeps). Does not own: which part a rank keeps (dist/tensor_parallel.cpp,
// dist/fsdp.cpp), or when the values are made (place(): each rank's tp part unless dist.zero = 3;
// else FullyShard, this rank's flat shard only).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace keel::models {

class DeferredInit {
 public:
  using Edit = std::function<void(torch::Tensor& whole)>;
  using Part = std::function<torch::Tensor(const torch::Tensor&)>;

  /// Whether `t` is a parameter of this object with no value made yet.
  bool deferred(const torch::Tensor& t) const { return entries_.count(t.unsafeGetTensorImpl()) != 0; }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

  /// Every parameter of `module` not yet deferred: its value as built dropped (the family's
  /// initialisation says what it is), its data a placeholder of its shape, dtype and device.
  /// A parameter left without a recipe has none: value() throws std::logic_error.
  void defer(torch::nn::Module& module);
  /// The recorded initialisation of a deferred parameter (the family's): a normal draw (the
  /// process's CPU default generator's state recorded, and the generator moved on as the draw
  /// moves it), a fill, or an edit of the whole value without random numbers (a padding row).
  /// A draw or a fill replaces what was recorded before it.
  void normal(const torch::Tensor& p, double mean, double std);
  void fill(const torch::Tensor& p, double value);
  void edit(const torch::Tensor& p, Edit edit);
  /// The whole value is what `rebuild()` returns when run with the CPU default generator set to
  /// `state` (the generator is set back after, and no DeferredInit is in use meanwhile; the
  /// generator is the process's, so no other thread may draw from it while values are made): a part
  /// built by LibTorch's own layers, whose initialisation draws happen inside their constructors,
  /// is made by building it again from where its build started (build_part()).
  void rebuilt(const torch::Tensor& p, torch::Tensor state, std::function<torch::Tensor()> rebuild);
  /// The whole value comes from `read` instead (model.init_from), converted to the parameter's
  /// dtype after its parts are cut (`read` may return a view of a mapped file).
  void from(const torch::Tensor& p, std::function<torch::Tensor()> read);
  /// The parameter keeps only part(value) from now on; its placeholder takes that part's shape.
  void keep_part(const torch::Tensor& p, Part part);
  /// Moves the placeholders to `device` (no values are made).
  void to(const torch::Device& device);

  /// The value of deferred parameter `p` (its parts cut), contiguous on the CPU in its dtype, or
  /// its `n` elements from `first` in row-major order (n < 0: all); `p` stays deferred. A file's
  /// tensor without parts is read for those elements only.
  torch::Tensor value(const torch::Tensor& p, int64_t first = 0, int64_t n = -1);
  /// Marks `p` made (its data set by the caller, or freed): no longer deferred.
  void done(const torch::Tensor& p) { entries_.erase(p.unsafeGetTensorImpl()); }
  /// Every deferred parameter of `params` made, on its placeholder's device, and set as its data.
  void make_all(const std::vector<std::pair<std::string, torch::Tensor>>& params);

  /// The largest whole tensor a value was made from so far (bytes), and whose it was.
  int64_t largest_transient_bytes() const { return largest_bytes_; }

  /// The DeferredInit in use on this thread, or null.
  static DeferredInit* current();
  /// Puts `d` in use on this thread for its lifetime (null: none).
  class Use {
   public:
    explicit Use(DeferredInit* d);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    DeferredInit* before_;
  };

 private:
  struct Entry {
    torch::Tensor param;                  // the parameter (its placeholder until made)
    std::vector<int64_t> sizes;           // the whole parameter's
    std::vector<Edit> edits;              // in order, on an uninitialised whole tensor (a draw or fill first)
    std::function<torch::Tensor()> read;  // or the file's tensor
    bool initialised = false;
    std::vector<Part> parts;
  };
  Entry& entry(const torch::Tensor& p);
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  int64_t largest_bytes_ = 0;
};

/// A placeholder of `sizes` (one element of storage, expanded): what a deferred parameter's data is.
torch::Tensor deferred_placeholder(const std::vector<int64_t>& sizes, const torch::TensorOptions& options);

/// Whether the built-in family `model_name` builds its parameters through defer_parameters() or
/// build_part(), so that model.sharded_init builds it as each rank's shards: gpt, gpt2, llama,
/// mlp and cnn. (A registered model that calls them is built sharded too; this names those known
/// in advance, for the memory pre-check.)
bool builds_deferred(const std::string& model_name);

/// The CPU default generator's state now (a copy).
torch::Tensor cpu_generator_state();

/// Defers the parameters of `part` (those not deferred yet) when a DeferredInit is in use, each
/// recorded as rebuilt(): the same-named parameter of `rebuild()` run from generator `state`.
void defer_rebuilt_part(torch::nn::Module& part, const torch::Tensor& state,
                        std::function<std::shared_ptr<torch::nn::Module>()> rebuild);

/// Builds one part of a model with `make` (a copyable callable returning a module holder, e.g.
/// `[=] { return torch::nn::Linear(in, out); }`) and, while a DeferredInit is in use, defers its
/// parameters with their initialisation recorded as "build it again from this generator state":
/// LibTorch's own initialisation of the layer (kaiming-uniform weights, uniform biases) is
/// replayed for the values, bit for bit, and the generator moves on exactly as the build moved
/// it. A rank holds the part whole while it is built, and again while one of its values is made.
template <class Make>
auto build_part(Make make) -> decltype(make()) {
  if (DeferredInit::current() == nullptr) return make();
  const torch::Tensor state = cpu_generator_state();
  auto part = make();
  defer_rebuilt_part(*part, state, [make]() -> std::shared_ptr<torch::nn::Module> { return make().ptr(); });
  return part;
}

/// What the families call (no-ops, or the operation itself on a parameter that is not deferred,
/// when no DeferredInit is in use): DeferredInit::defer, and the initialisation of one parameter.
void defer_parameters(torch::nn::Module& module);
void init_normal_(const torch::Tensor& p, double mean, double std);
void init_fill_(const torch::Tensor& p, double value);
void init_edit_(const torch::Tensor& p, const DeferredInit::Edit& edit);

}  // namespace keel::models
