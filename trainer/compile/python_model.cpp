#include "trainer/compile/python_model.h"

#include <cstdio>
#include <map>

#include "checkpoint/safetensors.h"
#include "common/atomic_file.h"
#include "common/file.h"
#include "common/log.h"
#include "common/sha256.h"
#include "keel/common/error.h"
#include "keel/trainer/config/config.h"
#include "trainer/compile/inductor.h"
#include "trainer/compile/packaging.h"

namespace keel {
namespace {

constexpr const char* kInitFormat = "keel-python-init/1";

std::vector<std::string> json_names(const std::map<std::string, std::string>& metadata, const std::string& key,
                                    const std::string& file) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) throw std::runtime_error(file + ": no \"" + key + "\" in its metadata");
  return nlohmann::json::parse(it->second).get<std::vector<std::string>>();
}

std::pair<std::string, std::string> split_last_dot(const std::string& name) {
  const auto dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

// A torch::nn::Module tree holding `tensors` under their dotted names: one submodule per prefix,
// made in the Python module's named_modules() order, so that named_parameters() and
// named_buffers() list them in PyTorch's order.
std::shared_ptr<torch::nn::Module> build_tree(const checkpoint::SafetensorsFile& f, const std::string& file) {
  std::map<std::string, torch::Tensor> by_name(f.tensors.begin(), f.tensors.end());
  auto root = std::make_shared<torch::nn::Module>();
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules{{"", root}};
  std::function<torch::nn::Module&(const std::string&)> node = [&](const std::string& path) -> torch::nn::Module& {
    if (auto it = modules.find(path); it != modules.end()) return *it->second;
    const auto [parent, leaf] = split_last_dot(path);
    auto m = std::make_shared<torch::nn::Module>();
    node(parent).register_module(leaf, m);
    modules[path] = m;
    return *m;
  };
  for (const auto& m : json_names(f.header.metadata, "modules", file)) node(m);
  auto take = [&](const std::string& name) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) throw std::runtime_error(file + ": lists \"" + name + "\" but holds no such tensor");
    return it->second;
  };
  const auto params = json_names(f.header.metadata, "parameters", file);
  const auto buffers = json_names(f.header.metadata, "buffers", file);
  for (const auto& n : params) {
    const auto [parent, leaf] = split_last_dot(n);
    node(parent).register_parameter(leaf, take(n).clone(), /*requires_grad=*/true);  // not a view of the mapped file
  }
  for (const auto& n : buffers) {
    const auto [parent, leaf] = split_last_dot(n);
    node(parent).register_buffer(leaf, take(n).clone());
  }
  std::vector<std::string> got;
  for (const auto& p : root->named_parameters(true)) got.push_back(p.key());
  std::vector<std::string> got_buffers;
  for (const auto& b : root->named_buffers(true)) got_buffers.push_back(b.key());
  if (got != params || got_buffers != buffers)
    throw std::runtime_error(file +
                             ": the C++ module does not list the parameters and buffers in the Python "
                             "module's order (a module registered under two names?)");
  return root;
}

// The module's initial parameters and buffers, made once per (module file, factory, seed, [model]
// section, torch) by the packaging step and kept in the compile cache; ranks sharing the cache wait
// for the one that makes it.
std::string initial_weights(const Config& cfg, const std::string& module_spec, const nlohmann::json& example) {
  const std::string script = aot::script_path();
  const nlohmann::json k = {{"format", kInitFormat}, {"script", aot::sha256_of_file(script)},
                            {"module", module_spec}, {"module_sha256", aot::sha256_of_file(cfg.model.path)},
                            {"seed", cfg.run.seed},  {"model_config", model_config_json(cfg)},
                            {"example", example},    {"torch", TORCH_VERSION}};
  nlohmann::json libraries = nlohmann::json::array();  // custom ops the module may call while it is built
  for (const auto& lib : cfg.compile.libraries) libraries.push_back(aot::sha256_of_file(lib));
  const std::string dir = aot::cache_root(cfg.compile) + "/inductor";
  if (const std::string err = make_dirs(dir); !err.empty()) throw InputError("compile.cache_dir: " + err);
  const std::string base = dir + "/init-" + sha256_hex(k.dump() + libraries.dump()).substr(0, 32);
  const std::string file = base + ".safetensors", log = base + ".log";
  const std::string what = "model.path = \"" + cfg.model.path + "\", model.factory = \"" + cfg.model.factory + "\": ";
  const std::string manifest = base + ".json";
  aot::EntryLock lock(base + ".lock");
  // Used only as its manifest describes it (the SHA-256 written when it was made): a file changed
  // on disk since, or one without a manifest, is taken again, never used silently.
  if (aot::is_file(file)) {
    try {
      if (!aot::is_file(manifest)) throw std::runtime_error("no manifest " + manifest);
      const auto m = nlohmann::json::parse(read_regular_file(manifest, 1 << 20));
      if (m.value("format", "") != kInitFormat || m.value("sha256", "") != aot::sha256_of_file(file))
        throw std::runtime_error("its SHA-256 differs from its manifest " + manifest + " (changed or damaged)");
      checkpoint::read_safetensors(file, "", /*load_tensors=*/false);
      return file;
    } catch (const std::exception& e) {
      logging::warn("model: {} cannot be used ({}); taking the initial weights again", file, e.what());
      std::remove(file.c_str());
      std::remove(manifest.c_str());
    }
  }
  std::vector<std::string> argv = {aot::python_for(cfg.compile),
                                   script,
                                   "--module",
                                   module_spec,
                                   "--example",
                                   example.dump(),
                                   "--model-config",
                                   model_config_json(cfg).dump(),
                                   "--seed",
                                   std::to_string(cfg.run.seed),
                                   "--init-out",
                                   file};
  for (auto& a : aot::library_args(cfg.compile.libraries)) argv.push_back(std::move(a));
  logging::info("model: taking the initial weights of {} (log: {})", module_spec, log);
  const int rc = aot::run_logged(argv, log, {});
  if (rc != 0 || !aot::is_file(file))
    aot::check_runs_python(cfg.compile, log);  // compile.python = "/bin/true" or "/bin/false": named
  // The module itself (not importable, a factory that fails or returns no module): not recorded,
  // since an import may fail for what the user installs next.
  if (rc == 2) throw InputError(what + aot::last_line(log));
  if (rc != 0)
    throw std::runtime_error("model.name = \"python\": the packaging step failed (exit " + std::to_string(rc) +
                             "): " + aot::last_line(log) + " (its log: " + log + ")");
  // Status 0 and no file: the module or its factory ended the interpreter (sys.exit(0), os._exit(0))
  // before the weights were written. The module's doing, named by its key.
  if (!aot::is_file(file))
    throw InputError(what +
                     "the packaging step ended with status 0 without writing the module's initial weights: the module "
                     "or its factory ended the Python interpreter (sys.exit, os._exit?) (its log: " +
                     log + ")");
  write_atomic(manifest, nlohmann::json{{"format", kInitFormat}, {"sha256", aot::sha256_of_file(file)}}.dump() + "\n");
  return file;
}

}  // namespace

std::shared_ptr<PythonModel> PythonModel::create(const Config& cfg, std::optional<models::InputKind> data_kind) {
  const auto& m = cfg.model;
  if (const std::string what = not_a_regular_file(m.path); !what.empty())
    throw InputError("model.path = \"" + m.path + "\": " + (what == "missing" ? "file not found" : "is " + what) +
                     " (model.name = \"python\" takes a Python file defining model.factory = \"" + m.factory + "\")");
  auto model = std::shared_ptr<PythonModel>(new PythonModel());
  const auto kind = m.input == ModelInput::Tokens  ? models::InputKind::Tokens
                    : m.input == ModelInput::Image ? models::InputKind::Image
                                                   : data_kind.value_or(models::InputKind::Image);
  model->spec_ = kind == models::InputKind::Tokens
                     ? models::InputSpec{models::InputKind::Tokens, {m.context}, m.vocab}
                     : models::InputSpec{models::InputKind::Image, {1, 28, 28}, m.num_classes};
  model->module_spec_ = m.path + ":" + m.factory;
  const std::string file = initial_weights(cfg, model->module_spec_, model->example(1));
  const auto f = checkpoint::read_safetensors(file);
  model->module_ = build_tree(f, file);
  logging::info("model: {} ({} parameters, {} buffers) from {}", model->module_spec_, model->named_parameters().size(),
                model->named_buffers().size(), file);
  return model;
}

nlohmann::json PythonModel::example(int64_t batch) const {
  std::vector<int64_t> input = {batch};
  input.insert(input.end(), spec_.sample_shape.begin(), spec_.sample_shape.end());
  const bool tokens = spec_.kind == models::InputKind::Tokens;
  return {{"input", {{"shape", input}, {"dtype", tokens ? "int64" : "float32"}}},
          {"target", {{"shape", tokens ? input : std::vector<int64_t>{batch}}, {"dtype", "int64"}}},
          {"classes", spec_.num_classes}};
}

models::NamedTensors PythonModel::named_parameters() const {
  models::NamedTensors out;
  for (const auto& p : module_->named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  return out;
}

models::NamedTensors PythonModel::named_buffers() const {
  models::NamedTensors out;
  for (const auto& b : module_->named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
  return out;
}

void PythonModel::attach(std::shared_ptr<InductorStep> step, bool evaluates) {
  if (step && evaluates && !step->has_forward())
    throw CompileError(
        "model.name = \"python\": the package has no evaluation forward, and the module has no C++ "
        "code to evaluate with: " +
        step->no_forward_reason());
  step_ = std::move(step);
}

torch::Tensor PythonModel::forward(const torch::Tensor& input) {
  if (module_->is_training())
    throw InputError("model.name = \"python\": a training batch of shape " + c10::str(input.sizes()) +
                     " does not fit the compiled step, and the module has no C++ code to run it eagerly; keep "
                     "batch shapes static (data.drop_last = true)");
  if (!step_ || !step_->has_forward()) throw std::logic_error("PythonModel::forward without an evaluation forward");
  std::vector<torch::Tensor> params, buffers;
  for (auto& [n, p] : named_parameters()) params.push_back(p);
  for (auto& [n, b] : named_buffers()) buffers.push_back(b);
  const int64_t n = input.size(0), batch = step_->eval_batch();
  std::vector<torch::Tensor> outs;
  for (int64_t at = 0; at < n; at += batch) {  // chunks of the package's batch, the last one padded
    torch::Tensor chunk = input.narrow(0, at, std::min(batch, n - at));
    const int64_t rows = chunk.size(0);
    if (rows < batch) {
      auto pad_shape = chunk.sizes().vec();
      pad_shape[0] = batch - rows;
      chunk = torch::cat({chunk, torch::zeros(pad_shape, chunk.options())});
    }
    outs.push_back(step_->forward(params, buffers, chunk).narrow(0, 0, rows));
  }
  return outs.size() == 1 ? outs[0] : torch::cat(outs);
}

}  // namespace keel
