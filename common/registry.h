// common/registry.h: a thread-safe name -> entry table, the one behind keel's model and dataset
// registries (torchtitan's TrainSpec registry plays this part there).
//
// Owns: adding an entry once per name (a second registration is an error, built-ins
// included), listing names, and looking one up with an error that lists the known names.
// Built-ins are added on first use by the owner (`builtins`), not by static initialisers,
// which a static library's linker may drop.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "keel/common/error.h"

namespace keel {

template <class Entry>
class Registry {
 public:
  /// `kind` names the entries in messages ("model"), `key` the config key that selects one
  /// ("model.name"); `builtins` fills the table on first use.
  Registry(std::string kind, std::string key, std::function<void(Registry&)> builtins)
      : kind_(std::move(kind)), key_(std::move(key)), builtins_(std::move(builtins)) {}

  /// Throws std::invalid_argument for an empty or taken name.
  void add(const std::string& name, Entry entry) {
    std::lock_guard<std::mutex> lock(mu_);
    init_locked();
    add_locked(name, std::move(entry));
  }
  std::vector<std::string> names() {
    std::lock_guard<std::mutex> lock(mu_);
    init_locked();
    std::vector<std::string> out;
    for (const auto& kv : entries_) out.push_back(kv.first);
    return out;
  }
  /// A copy of the entry; InputError naming the key and the known names when there is none.
  Entry get(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    init_locked();
    auto it = entries_.find(name);
    if (it != entries_.end()) return it->second;
    std::string known;
    for (const auto& kv : entries_) known += (known.empty() ? "" : ", ") + kv.first;
    throw InputError(key_ + " = \"" + name + "\" is not a registered " + kind_ + "; known: " + known);
  }
  /// For `builtins`: adds without taking the lock (it is held).
  void add_builtin(const std::string& name, Entry entry) { add_locked(name, std::move(entry)); }

 private:
  void init_locked() {
    if (builtins_) {
      auto b = std::move(builtins_);
      builtins_ = nullptr;
      b(*this);
    }
  }
  void add_locked(const std::string& name, Entry entry) {
    if (name.empty()) throw std::invalid_argument("register_" + kind_ + ": empty " + kind_ + " name");
    if (!entries_.emplace(name, std::move(entry)).second)
      throw std::invalid_argument("register_" + kind_ + ": a " + kind_ + " named \"" + name +
                                  "\" is already registered (each name once; pick another name)");
  }

  std::string kind_, key_;
  std::function<void(Registry&)> builtins_;
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

}  // namespace keel
