// checkpoint/stateful.h: how a component puts its state into a checkpoint and takes it back.
//
// Owns: the Stateful interface and StateRegistry, the list the trainer hands to the
// checkpointer. Each component (model, optimizer, GradScaler, sampler, RNG, the user's extras)
// writes its own checkpoint::Component, under the name it is registered with, and reads it
// back from what load() found; a new piece of state is one registration, never edits in save
// and load (torchtitan hands its checkpointer a dict of objects with
// state_dict()/load_state_dict() the same way). No component sees another's values.
// Does not own: the file format (checkpoint/checkpoint.h), when to save (the trainer).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpointer.h"

namespace keel::checkpoint {

class Stateful {
 public:
  virtual ~Stateful() = default;
  /// Fills in this component's part of a step (called on every rank, at the same step).
  virtual void save(Component& mine) const = 0;
  /// Restores from a loaded step: `mine` is what this component saved (Loaded::component),
  /// with this rank's own part when `loaded.has_rank_state`; `loaded.saved_world_size` is the
  /// world of the job that saved it. Throws keel::InputError when the checkpoint does not fit
  /// this run (the user's choice of checkpoint), std::runtime_error when it is damaged.
  virtual void load(const Loaded& loaded, const LoadedComponent& mine) = 0;
  /// Checks what load() would read (types, ranges, agreement with this run) without changing
  /// anything: "" when it is usable, else the problem, naming the field. Values in a checkpoint
  /// are never trusted: a failed check is treated like a failed checksum (the loader warns and
  /// falls back to the previous committed step). Differences the user chose (another model,
  /// another optimizer) are load()'s InputError instead, never a silent fallback.
  virtual std::string check(const Loaded& loaded, const LoadedComponent& mine) const { return ""; }
};

/// An ordered list of named components: save() asks each for its Component of that name in
/// registration order, load() restores each in the same order.
class StateRegistry {
 public:
  /// `component` must outlive the registry. `name` names its part of every step ([a-z0-9_],
  /// unique).
  void add(std::string name, Stateful& component);
  State save() const;
  void load(const Loaded& loaded) const;
  /// The first component's problem with `loaded` ("<name>: <problem>"), or "".
  std::string check(const Loaded& loaded) const;
  std::vector<std::string> names() const;

 private:
  std::vector<std::pair<std::string, Stateful*>> components_;
};

}  // namespace keel::checkpoint
