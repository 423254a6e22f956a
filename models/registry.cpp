
#include "keel/models/model.h"

#include "common/registry.h"
#include "models/hf.h"
#include "models/transformer.h"

namespace keel::models {

const char* input_kind_name(InputKind k) {
  switch (k) {
    case InputKind::Image:
      return "image";
    case InputKind::Tokens:
      return "tokens";
    case InputKind::Features:
      return "features";
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

Registry<ModelFactory>& registry() {
  static Registry<ModelFactory> r("model", "model.name", [](Registry<ModelFactory>& t) {
    t.add_builtin("mlp", [](const ModelConfig& c, std::optional<InputKind>) { return make_mlp(c); });
    t.add_builtin("cnn", [](const ModelConfig& c, std::optional<InputKind>) { return make_cnn(c); });
    for (const auto* f : {&gpt_family(), &gpt2_family(), &llama_family()})
      t.add_builtin(f->name, [make = f->factory](const ModelConfig& c, std::optional<InputKind>) { return make(c); });
    t.add_builtin("torchscript", make_torchscript);
  });
  return r;
}

}  // namespace

void register_model(const std::string& name, ModelFactory factory) { registry().add(name, std::move(factory)); }

std::vector<std::string> registered_models() { return registry().names(); }

std::shared_ptr<Model> create_model(const ModelConfig& cfg, std::optional<InputKind> data_kind) {
  return registry().get(cfg.name)(cfg, data_kind);
}

}  // namespace keel::models
