#include <map>
#include <mutex>
#include <stdexcept>

#include "keel/models/model.h"

namespace keel::models {

const char* input_kind_name(InputKind k) {
  switch (k) {
    case InputKind::Image: return "image";
    case InputKind::Tokens: return "tokens";
    case InputKind::Features: return "features";
  }
  return "?";
}

std::vector<torch::Tensor> Model::parameters() const {
  std::vector<torch::Tensor> out;
  for (auto& p : named_parameters()) out.push_back(p.second);
  return out;
}

int64_t Model::num_parameters() const {
  int64_t n = 0;
  for (auto& p : named_parameters()) n += p.second.numel();
  return n;
}

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, ModelFactory> factories;
};

// Built-ins are added on first use rather than by static initialisers, which a static
// library's linker may drop.
Registry& registry() {
  static Registry r;
  static std::once_flag once;
  std::call_once(once, [] {
    r.factories["mlp"] = [](const ModelConfig& c, std::optional<InputKind>) { return make_mlp(c); };
    r.factories["cnn"] = [](const ModelConfig& c, std::optional<InputKind>) { return make_cnn(c); };
    r.factories["gpt"] = [](const ModelConfig& c, std::optional<InputKind>) { return make_gpt(c); };
    r.factories["torchscript"] = make_torchscript;
  });
  return r;
}

}  // namespace

void register_model(const std::string& name, ModelFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (name.empty()) throw std::invalid_argument("register_model: empty model name");
  if (!r.factories.emplace(name, std::move(factory)).second)
    throw std::invalid_argument("register_model: a model named \"" + name +
                                "\" is already registered (each name once; pick another name)");
}

std::vector<std::string> registered_models() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (auto& kv : r.factories) names.push_back(kv.first);
  return names;
}

std::shared_ptr<Model> create_model(const ModelConfig& cfg, std::optional<InputKind> data_kind) {
  ModelFactory f;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(cfg.name);
    if (it == r.factories.end()) {
      std::string known;
      for (auto& kv : r.factories) known += (known.empty() ? "" : ", ") + kv.first;
      throw InputError("model.name = \"" + cfg.name + "\" is not a registered model; known: " + known);
    }
    f = it->second;
  }
  return f(cfg, data_kind);
}

}  // namespace keel::models
