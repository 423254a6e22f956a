#include "models/deferred_init.h"

#include <ATen/CPUGeneratorImpl.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <mutex>
#include <stdexcept>
#include <utility>

#include "models/transformer.h"

namespace keel::models {

namespace {
thread_local DeferredInit* current_init = nullptr;

// Gives the pages of a freed transient whole tensor back to the system. keel's allocator tuning
// (trainer/setup.cpp: glibc keeps freed memory up to 1 GiB) would otherwise keep them resident,
// and the small allocations that follow split the freed block, so that the next whole tensor
// grows the heap again: the resident memory would add up the transients it exists to avoid.
void release_transient(int64_t bytes) {
#ifdef __GLIBC__
  if (bytes >= (int64_t{1} << 20)) malloc_trim(0);
#else
  (void)bytes;
#endif
}

std::string shape_of(const std::vector<int64_t>& sizes) { return c10::str(c10::IntArrayRef(sizes)); }

// Sets the CPU default generator to a state for its lifetime, and back after.
class GeneratorStateSet {
 public:
  explicit GeneratorStateSet(const torch::Tensor& state) : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    before_ = gen_.get_state();
    gen_.set_state(state);
  }
  ~GeneratorStateSet() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(before_);
  }
  GeneratorStateSet(const GeneratorStateSet&) = delete;
  GeneratorStateSet& operator=(const GeneratorStateSet&) = delete;

 private:
  at::Generator gen_;
  torch::Tensor before_;
};
}  // namespace

bool builds_deferred(const std::string& model_name) {
  return transformer_family(model_name) != nullptr || model_name == "mlp" || model_name == "cnn";
}

torch::Tensor cpu_generator_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

torch::Tensor deferred_placeholder(const std::vector<int64_t>& sizes, const torch::TensorOptions& options) {
  return torch::zeros({1}, options.requires_grad(false)).expand(sizes);
}

DeferredInit* DeferredInit::current() { return current_init; }
DeferredInit::Use::Use(DeferredInit* d) : before_(current_init) { current_init = d; }
DeferredInit::Use::~Use() { current_init = before_; }

void DeferredInit::defer(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  int64_t freed = 0;
  for (auto& p : module.parameters()) {
    if (deferred(p)) continue;
    Entry e;
    e.param = p;
    e.sizes = p.sizes().vec();
    entries_.emplace(p.unsafeGetTensorImpl(), std::move(e));
    freed += p.numel() * static_cast<int64_t>(p.element_size());
    p.set_data(deferred_placeholder(p.sizes().vec(), p.options()));
  }
  release_transient(freed);
}

DeferredInit::Entry& DeferredInit::entry(const torch::Tensor& p) {
  auto it = entries_.find(p.unsafeGetTensorImpl());
  if (it == entries_.end()) throw std::logic_error("DeferredInit: a parameter that is not deferred");
  return it->second;
}

void DeferredInit::normal(const torch::Tensor& p, double mean, double std) {
  Entry& e = entry(p);
  const torch::Tensor state = cpu_generator_state();
  // The generator moves on as the draw into the whole parameter moves it: the same kernel over a
  // contiguous tensor of its shape and dtype (transient).
  torch::empty(e.sizes, torch::TensorOptions().dtype(e.param.scalar_type())).normal_(mean, std);
  const int64_t bytes = c10::multiply_integers(e.sizes) * static_cast<int64_t>(c10::elementSize(e.param.scalar_type()));
  largest_bytes_ = std::max(largest_bytes_, bytes);
  release_transient(bytes);
  e.edits.clear();
  e.read = nullptr;
  e.edits.push_back([state, mean, std](torch::Tensor& whole) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>();
    g.set_state(state);
    whole.normal_(mean, std, g);
  });
  e.initialised = true;
}

void DeferredInit::fill(const torch::Tensor& p, double value) {
  Entry& e = entry(p);
  e.edits.clear();
  e.read = nullptr;
  e.edits.push_back([value](torch::Tensor& whole) { whole.fill_(value); });
  e.initialised = true;
}

void DeferredInit::edit(const torch::Tensor& p, Edit edit) { entry(p).edits.push_back(std::move(edit)); }

void DeferredInit::rebuilt(const torch::Tensor& p, torch::Tensor state, std::function<torch::Tensor()> rebuild) {
  Entry& e = entry(p);
  e.edits.clear();
  e.read = nullptr;
  e.edits.push_back([state = std::move(state), rebuild = std::move(rebuild)](torch::Tensor& whole) {
    const Use none(nullptr);
    const GeneratorStateSet from(state);
    whole.copy_(rebuild());
  });
  e.initialised = true;
}

void DeferredInit::from(const torch::Tensor& p, std::function<torch::Tensor()> read) {
  Entry& e = entry(p);
  e.edits.clear();
  e.read = std::move(read);
  e.initialised = true;
}

void DeferredInit::keep_part(const torch::Tensor& p, Part part) {
  Entry& e = entry(p);
  // The part's shape, from the placeholder's (a view; nothing is made).
  const torch::Tensor shape = part(torch::empty(p.sizes(), p.options().device(torch::kMeta)));
  e.parts.push_back(std::move(part));
  torch::NoGradGuard no_grad;
  p.set_data(deferred_placeholder(shape.sizes().vec(), p.options()));
}

void DeferredInit::to(const torch::Device& device) {
  torch::NoGradGuard no_grad;
  for (auto& [impl, e] : entries_)
    if (e.param.device() != device)
      e.param.set_data(deferred_placeholder(e.param.sizes().vec(), e.param.options().device(device)));
}

torch::Tensor DeferredInit::value(const torch::Tensor& p, int64_t first, int64_t n) {
  const Entry& e = entry(p);
  if (!e.initialised)
    throw std::logic_error("DeferredInit: a deferred parameter of shape " + shape_of(e.sizes) +
                           " has no initialisation recorded");
  torch::Tensor t;
  torch::NoGradGuard no_grad;
  if (e.read) {
    t = e.read();
    if (e.parts.empty() && n >= 0) t = t.reshape({-1}).narrow(0, first, n), first = 0, n = -1;  // (a view)
  } else {
    t = torch::empty(e.sizes, torch::TensorOptions().dtype(e.param.scalar_type()));
    for (const auto& edit : e.edits) edit(t);
  }
  const int64_t bytes = e.read ? 0 : t.numel() * static_cast<int64_t>(t.element_size());  // (a file's: mapped)
  largest_bytes_ = std::max(largest_bytes_, bytes);
  for (const auto& part : e.parts) t = part(t);
  if (n >= 0) t = t.reshape({-1}).narrow(0, first, n);
  // A copy of its own in the parameter's dtype (a file's tensor may be a view of its mapping).
  torch::Tensor made = t.to(torch::TensorOptions().dtype(e.param.scalar_type()).device(torch::kCPU),
                            /*non_blocking=*/false, /*copy=*/true)
                           .contiguous();
  t = torch::Tensor();
  release_transient(bytes);
  return made;
}

void DeferredInit::make_all(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    if (!deferred(p)) continue;
    torch::Tensor made = value(p).to(p.device());
    p.set_data(made);
    done(p);
  }
}

void defer_parameters(torch::nn::Module& module) {
  if (DeferredInit* d = DeferredInit::current()) d->defer(module);
}

void defer_rebuilt_part(torch::nn::Module& part, const torch::Tensor& state,
                        std::function<std::shared_ptr<torch::nn::Module>()> rebuild) {
  DeferredInit* d = DeferredInit::current();
  if (d == nullptr) return;
  std::vector<std::pair<std::string, torch::Tensor>> fresh;
  for (const auto& item : part.named_parameters())
    if (!d->deferred(item.value())) fresh.emplace_back(item.key(), item.value());
  d->defer(part);
  const auto shared = std::make_shared<std::function<std::shared_ptr<torch::nn::Module>()>>(std::move(rebuild));
  for (const auto& [name, p] : fresh)
    d->rebuilt(p, state, [shared, name = name] { return (*shared)()->named_parameters()[name].detach(); });
}

void init_normal_(const torch::Tensor& p, double mean, double std) {
  DeferredInit* d = DeferredInit::current();
  if (d && d->deferred(p)) return d->normal(p, mean, std);
  torch::NoGradGuard no_grad;
  p.normal_(mean, std);
}

void init_fill_(const torch::Tensor& p, double value) {
  DeferredInit* d = DeferredInit::current();
  if (d && d->deferred(p)) return d->fill(p, value);
  torch::NoGradGuard no_grad;
  p.fill_(value);
}

void init_edit_(const torch::Tensor& p, const DeferredInit::Edit& edit) {
  DeferredInit* d = DeferredInit::current();
  if (d && d->deferred(p)) return d->edit(p, edit);
  torch::NoGradGuard no_grad;
  torch::Tensor t = p;
  edit(t);
}

}  // namespace keel::models
