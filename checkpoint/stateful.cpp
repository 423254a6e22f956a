#include "checkpoint/stateful.h"

#include <stdexcept>

namespace keel::checkpoint {

void StateRegistry::add(std::string name, Stateful& component) {
  for (const auto& [n, c] : components_)
    if (n == name) throw std::logic_error("checkpoint state '" + name + "' is registered twice");
  components_.emplace_back(std::move(name), &component);
}

State StateRegistry::save() const {
  State st;
  for (const auto& [name, c] : components_) c->save(st[name]);
  return st;
}

void StateRegistry::load(const Loaded& loaded) const {
  for (const auto& [name, c] : components_) c->load(loaded, loaded.component(name));
}

std::string StateRegistry::check(const Loaded& loaded) const {
  for (const auto& [name, c] : components_) {
    std::string problem;
    try {
      problem = c->check(loaded, loaded.component(name));
    } catch (const std::exception& e) {
      problem = e.what();
    }
    if (!problem.empty()) return name + ": " + problem;
  }
  return "";
}

std::vector<std::string> StateRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [n, c] : components_) out.push_back(n);
  return out;
}

}  // namespace keel::checkpoint
