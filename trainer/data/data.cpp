#include "keel/trainer/data/data.h"

#include "common/registry.h"
#include "trainer/data/token_file.h"

namespace keel::data {
namespace {

struct Entry {
  DatasetFactory factory;
  std::optional<models::InputKind> native;
};

Registry<Entry>& registry() {
  static Registry<Entry> r("dataset", "data.name", [](Registry<Entry>& t) {
    t.add_builtin("fashion_mnist",
                  {[](const DataConfig& c, const models::InputSpec& s, int64_t) { return make_fashion_mnist(c, s); },
                   models::InputKind::Image});
    t.add_builtin("text", {[](const DataConfig& c, const models::InputSpec& s, int64_t) { return make_text(c, s); },
                           models::InputKind::Tokens});
    t.add_builtin("tokens", {[](const DataConfig& c, const models::InputSpec& s, int64_t) { return make_tokens(c, s); },
                             models::InputKind::Tokens});
    t.add_builtin("synthetic", {make_synthetic, std::nullopt});
  });
  return r;
}

}  // namespace

void register_dataset(const std::string& name, DatasetFactory factory, std::optional<models::InputKind> native_kind) {
  registry().add(name, Entry{std::move(factory), native_kind});
}

std::vector<std::string> registered_datasets() { return registry().names(); }

std::optional<models::InputKind> native_input_kind(const std::string& name) { return registry().get(name).native; }

Splits create_dataset(const DataConfig& cfg, const models::InputSpec& spec, int64_t seed) {
  Entry e = registry().get(cfg.name);
  if (e.native && *e.native != spec.kind)
    throw InputError("data.name = \"" + cfg.name + "\" gives " + models::input_kind_name(*e.native) +
                     " but the model expects " + models::input_kind_name(spec.kind) +
                     " input; choose a matching model or dataset");
  Splits s = e.factory(cfg, spec, seed);
  if (!s.train || s.train->size() == 0) throw InputError("data.name = \"" + cfg.name + "\": the train split is empty");
  return s;
}

}  // namespace keel::data
