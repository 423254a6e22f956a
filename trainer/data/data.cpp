#include "keel/trainer/data/data.h"

#include <map>
#include <mutex>
#include <stdexcept>

namespace keel::data {
namespace {

struct Entry {
  DatasetFactory factory;
  std::optional<models::InputKind> native;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, Entry> entries;
};

Registry& registry() {
  static Registry r;
  static std::once_flag once;
  std::call_once(once, [] {
    r.entries["fashion_mnist"] = {[](const DataConfig& c, const models::InputSpec& s, int64_t) {
                                    return make_fashion_mnist(c, s);
                                  },
                                  models::InputKind::Image};
    r.entries["text"] = {[](const DataConfig& c, const models::InputSpec& s, int64_t) {
                           return make_text(c, s);
                         },
                         models::InputKind::Tokens};
    r.entries["synthetic"] = {make_synthetic, std::nullopt};
  });
  return r;
}

Entry lookup(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(name);
  if (it == r.entries.end()) {
    std::string known;
    for (auto& kv : r.entries) known += (known.empty() ? "" : ", ") + kv.first;
    throw InputError("data.name = \"" + name + "\" is not a registered dataset; known: " + known);
  }
  return it->second;
}

}  // namespace

void register_dataset(const std::string& name, DatasetFactory factory,
                      std::optional<models::InputKind> native_kind) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (name.empty()) throw std::invalid_argument("register_dataset: empty dataset name");
  if (!r.entries.emplace(name, Entry{std::move(factory), native_kind}).second)
    throw std::invalid_argument("register_dataset: a dataset named \"" + name +
                                "\" is already registered (each name once; pick another name)");
}

std::vector<std::string> registered_datasets() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (auto& kv : r.entries) out.push_back(kv.first);
  return out;
}

std::optional<models::InputKind> native_input_kind(const std::string& name) {
  return lookup(name).native;
}

Splits create_dataset(const DataConfig& cfg, const models::InputSpec& spec, int64_t seed) {
  Entry e = lookup(cfg.name);
  if (e.native && *e.native != spec.kind)
    throw InputError("data.name = \"" + cfg.name + "\" gives " + models::input_kind_name(*e.native) +
                     " but the model expects " + models::input_kind_name(spec.kind) +
                     " input; choose a matching model or dataset");
  Splits s = e.factory(cfg, spec, seed);
  if (!s.train || s.train->size() == 0)
    throw InputError("data.name = \"" + cfg.name + "\": the train split is empty");
  return s;
}

}  // namespace keel::data
