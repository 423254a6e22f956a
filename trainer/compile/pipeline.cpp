#include "keel/trainer/compile/pipeline.h"

namespace keel {

PlacedModel place(std::shared_ptr<models::Model> model, const torch::Device& device) {
  model->to(device);
  auto check = [&](const models::NamedTensors& tensors, const char* kind) {
    for (const auto& [name, t] : tensors)
      if (t.device() != device)
        throw std::runtime_error(std::string("place: ") + kind + " '" + name + "' of model " + model->name() +
                                 " is on " + t.device().str() + ", not on " + device.str() +
                                 " (a tensor the model holds outside its registered parameters and buffers?)");
  };
  check(model->named_parameters(), "parameter");
  check(model->named_buffers(), "buffer");
  return PlacedModel(std::move(model), device);
}

CompiledModel PlacedModel::compile(const CompileConfig& cfg, const torch::Tensor& example,
                                   const std::string& identity) && {
  auto report = std::make_shared<CompileReport>();
  auto compiled = compile_model(std::move(model_), cfg, example.to(device_), *report, identity);
  return CompiledModel(std::move(compiled), device_, std::move(report));
}

DistributedModel CompiledModel::distribute(std::shared_ptr<dist::Collectives> coll, const DistConfig& cfg) && {
  auto ddp = std::make_unique<dist::DataParallel>(model_, std::move(coll), cfg);
  return DistributedModel(std::move(model_), device_, std::move(report_), std::move(ddp));
}

}  // namespace keel
