// What a config may ask for beyond the schema's per-key ranges: exclusive maxima, and the memory
// a config needs, estimated from the config alone before anything is allocated.
//
// The memory estimate is a lower bound: only tensors that a run allocates for certain are
// counted, so that a config it refuses cannot run, and a config that can run is never refused.
// The models' shapes are those of models/mlp.cpp, models/cnn.cpp and models/gpt.cpp; the
// synthetic data's are those of trainer/data/datasets.cpp (make_synthetic) and the sampler's
// (trainer/data/sampler.cpp). tests/test_limits.cpp checks the parameter counts against the
// models that are built.
#include "trainer/config/limits.h"

#include <sys/resource.h>
#include <unistd.h>

#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "dist/placement.h"
#include "keel/common/error.h"
#include "models/deferred_init.h"
#include "models/hf.h"

namespace keel {
namespace {

// Input of the built-in image models: (1, 28, 28) float32 (models/mlp.cpp, models/cnn.cpp).
constexpr double kImageFeatures = 784;

std::string bytes_text(double b) {
  static const char* const units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  while (b >= 1000.0 && u < 6) {
    b /= 1000.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f bytes", b);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", b, units[u]);
  return buf;
}

std::string count_text(double n) {
  char buf[64];
  if (n < 1e9)
    std::snprintf(buf, sizeof buf, "%.0f", n);
  else
    std::snprintf(buf, sizeof buf, "%.2g", n);
  return buf;
}

// A config key that sizes a part, as written in the message.
struct KeyUse {
  std::string name;       // "model.width", or a config.json field ("n_embd")
  int64_t value = 0;      // as configured
  int64_t effective = 0;  // after the model's default (model.width = 0 -> 256)
  double reference = 1;   // its default: the key furthest above it is the one to lower
  std::string file;       // the config.json (model.init_from) the value came from, or ""
  std::string where() const { return file.empty() ? name : name + " in " + file; }
};

std::string key_text(const KeyUse& k) {
  std::string s = k.name + " = " + std::to_string(k.value);
  if (k.value != k.effective) s += " (the default, " + std::to_string(k.effective) + ")";
  return k.file.empty() ? s : s + " in " + k.file;
}

std::string keys_text(const std::vector<KeyUse>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i) s += i + 1 == keys.size() ? " and " : ", ";
    s += key_text(keys[i]);
  }
  return s;
}

std::string culprit_of(const std::vector<KeyUse>& keys) {
  std::string best;
  double best_ratio = -1;
  for (const auto& k : keys) {
    const double ratio = static_cast<double>(k.effective) / std::max(1.0, k.reference);
    if (ratio > best_ratio) best_ratio = ratio, best = k.where();
  }
  return best;
}

// The shape of a built-in model, defaults applied as the model's factory applies them.
struct Shape {
  std::string name;  // mlp | cnn | gpt | gpt2 | llama
  double width = 0, depth = 0;
  std::optional<models::HfShape> hf;  // gpt2, llama: the family's shape (config.json or the [model] keys)
  bool sequence() const { return name == "gpt" || hf.has_value(); }
};

std::optional<Shape> builtin_shape(const ModelConfig& m) {
  if (m.name == "mlp") return Shape{"mlp", double(m.width > 0 ? m.width : 256), double(m.depth > 0 ? m.depth : 8), {}};
  if (m.name == "cnn") return Shape{"cnn", 0, 0, {}};
  if (m.name == "gpt") return Shape{"gpt", double(m.width > 0 ? m.width : 256), double(m.depth > 0 ? m.depth : 4), {}};
  if (models::is_hf_family(m.name)) {
    // A shape the family cannot build is refused when the model is built, on every rank together
    // (Trainer's build_model_on_every_rank): no estimate for it here.
    try {
      models::HfShape hf = models::hf_shape(m);
      return Shape{m.name, double(hf.width), double(hf.layers), std::move(hf)};
    } catch (const InputError&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

// gpt2 and llama as their families build them (models/gpt2.cpp, models/llama.cpp).
double hf_parameters(const models::HfShape& s) {
  const double V = double(s.vocab), d = double(s.width), L = double(s.layers), F = double(s.ffn);
  const double head = s.tied ? 0 : V * d;
  if (s.family == "gpt2")  // wte, wpe; per block ln_1, c_attn, c_proj, ln_2, c_fc, c_proj; ln_f
    return V * d + double(s.positions) * d +
           L * (2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d + d * F + F + F * d + d) + 2 * d + head;
  // llama: embed_tokens; per layer two RMS norms, q, k, v, o, gate, up, down (biases if asked); norm
  const double q = double(s.heads * s.head_dim), kv = double(s.kv_heads * s.head_dim);
  const double attention = d * q + 2 * d * kv + q * d + (s.attention_bias ? q + 2 * kv + d : 0);
  const double mlp = 3 * d * F + (s.mlp_bias ? 2 * F + d : 0);
  return V * d + L * (2 * d + attention + mlp) + d + head;
}

}  // namespace

std::optional<double> estimate_parameters(const ModelConfig& m) {
  const auto shape = builtin_shape(m);
  if (!shape) return std::nullopt;
  if (shape->hf) return hf_parameters(*shape->hf);
  const double classes = static_cast<double>(m.num_classes);
  if (shape->name == "mlp") {
    // Linear(784, w), depth - 1 x Linear(w, w), Linear(w, classes); weights and biases.
    const double w = shape->width, layers = shape->depth;
    return kImageFeatures * w + w + (layers - 1) * (w * w + w) + w * classes + classes;
  }
  if (shape->name == "cnn") {
    // conv1 (1 -> 32, 3x3), conv2 (32 -> 64, 3x3), fc1 (3136 -> 128), fc2 (128 -> classes).
    return (1 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + (64 * 7 * 7 * 128 + 128) + 128 * classes + classes;
  }
  // gpt: wte (vocab x d, tied to the output), wpe (context x d), per block ln_1, c_attn (d -> 3d),
  // c_proj (d -> d), ln_2, c_fc (d -> 4d), c_proj (4d -> d): 12 d^2 + 13 d; ln_f.
  const double d = shape->width, layers = shape->depth;
  return static_cast<double>(m.vocab) * d + static_cast<double>(m.context) * d + layers * (12 * d * d + 13 * d) + 2 * d;
}

std::optional<double> estimate_replicated_parameters(const ModelConfig& m) {
  const auto shape = builtin_shape(m);
  if (!shape || !shape->sequence()) return std::nullopt;
  // What each family's tp plan (models/transformer.cpp, tensor_parallel_plan) does not split: per
  // block the two norms and the row-parallel projections' biases; the position embedding and the
  // final norm. The token embedding and an lm_head are split by vocabulary rows.
  if (shape->hf && shape->hf->family == "llama") {
    const models::HfShape& s = *shape->hf;
    const double d = double(s.width);
    return double(s.layers) * (2 * d + (s.attention_bias ? d : 0) + (s.mlp_bias ? d : 0)) + d;
  }
  const double d = shape->hf ? double(shape->hf->width) : shape->width;
  const double layers = shape->hf ? double(shape->hf->layers) : shape->depth;
  const double positions = shape->hf ? double(shape->hf->positions) : double(m.context);
  return layers * 6 * d + positions * d + 2 * d;  // ln_1, ln_2 (weight and bias), two biases
}

// The keys an estimate names, with the values it used.
struct EstimateKeys {
  KeyUse width, depth, classes, context, vocab, heads, batch, size;
};

EstimateKeys estimate_keys(const Config& cfg, const std::optional<Shape>& shape) {
  const Config defaults;
  const int64_t default_depth = shape && shape->name == "gpt" ? 4 : 8;
  const auto dflt = [](int64_t v) { return static_cast<double>(v); };
  EstimateKeys k;
  k.width = {"model.width", cfg.model.width, shape ? static_cast<int64_t>(shape->width) : cfg.model.width, 256};
  k.depth = {"model.depth", cfg.model.depth, shape ? static_cast<int64_t>(shape->depth) : cfg.model.depth,
             dflt(default_depth)};
  k.classes = {"model.num_classes", cfg.model.num_classes, cfg.model.num_classes, dflt(defaults.model.num_classes)};
  k.context = {"model.context", cfg.model.context, cfg.model.context, dflt(defaults.model.context)};
  const bool hf = shape && shape->hf;  // a Hugging Face family: its vocabulary and heads (config.json's)
  k.vocab = {"model.vocab", cfg.model.vocab, hf ? shape->hf->vocab : cfg.model.vocab, dflt(defaults.model.vocab)};
  k.heads = {"model.heads", cfg.model.heads, hf ? shape->hf->heads : cfg.model.heads, dflt(defaults.model.heads)};
  // A Hugging Face family read from init_from's config.json: its values, named by the file's fields.
  if (hf && !shape->hf->source.empty()) {
    const models::HfShape& s = *shape->hf;
    auto from_file = [&](KeyUse& u, const std::string& key) {
      const std::string o = s.origin(key);  // "n_embd in DIR/config.json"
      u.name = o.substr(0, o.find(" in "));
      u.value = u.effective;
      u.file = s.source;
    };
    from_file(k.width, "model.width");
    from_file(k.depth, "model.depth");
    from_file(k.vocab, "model.vocab");
    from_file(k.heads, "model.heads");
  }
  k.batch = {"train.batch_size", cfg.train.batch_size, cfg.train.batch_size, dflt(defaults.train.batch_size)};
  k.size = {"data.synthetic_size", cfg.data.synthetic_size, cfg.data.synthetic_size,
            dflt(defaults.data.synthetic_size)};
  return k;
}

// Parameters (float32: autocast keeps them so), their gradients, the optimizer's state.
struct ModelMemory {
  double P = 0, G = 0, S = 0;
  double P_held = 0;           // the parameters a rank holds while it trains: P, or its shard with dist.zero = 3
                               // (G: the gradients it keeps, sharded from dist.zero = 2)
  MemoryItem item, host_item;  // all of it; on a GPU, the parameters built on the CPU
};

ModelMemory model_memory(const Config& cfg, int64_t dp_size, const Shape& shape, double params, const EstimateKeys& k) {
  ModelMemory m;
  std::string state_name = "no optimizer state";
  // parallel.tp: a rank holds its slices of the split parameters and the replicated ones whole
  // (docs/parallel.md: (P - P_r) / t + P_r); ZeRO then divides that over dp.
  const double t = static_cast<double>(std::max<int64_t>(1, cfg.parallel.tp));
  const double whole = params;
  if (t > 1) {
    const double replicated = estimate_replicated_parameters(cfg.model).value_or(0);
    params = (whole - replicated) / t + replicated;
  }
  m.P = 4 * params;
  m.G = m.P;
  if (cfg.train.optimizer == "adamw")
    m.S = 2 * m.P, state_name = "AdamW state";
  else if (cfg.train.optimizer != "sgd")
    m.S = 2 * m.P, state_name = "the state of optimizer \"" + cfg.train.optimizer + "\" (estimated as AdamW's)";
  else if (cfg.train.momentum > 0)
    m.S = m.P, state_name = "SGD momentum";
  const dist::Placement placement(cfg.dist.zero);
  if (placement.shards_optimizer_state()) m.S /= static_cast<double>(dp_size);
  m.P_held = m.P;
  // Stage 2 keeps full gradients through the micro-batches that do not sync (as DDP), stage 3
  // reduce-scatters every micro-batch.
  if (placement.shards_parameters() || (placement.shards_gradients() && cfg.train.grad_accum == 1))
    m.G /= static_cast<double>(dp_size);
  if (placement.shards_parameters()) m.P_held /= static_cast<double>(dp_size);
  const double bytes = m.P_held + m.G + m.S;
  std::vector<KeyUse> keys;
  if (shape.name == "mlp")
    keys = {k.width, k.depth, k.classes};
  else if (shape.name == "cnn")
    keys = {k.classes};
  else
    keys = {k.width, k.depth, k.vocab, k.context};
  const std::string per_rank =
      t > 1 ? ", of which one rank of parallel.tp = " + std::to_string(cfg.parallel.tp) + " holds " + count_text(params)
            : std::string();
  const std::string head = keys_text(keys) + (keys.size() > 1 ? " make" : " makes") + " the " + shape.name + " model " +
                           count_text(whole) + " parameters" + per_rank + ": ";
  m.item = {head + bytes_text(bytes) + " with gradients and " + state_name, culprit_of(keys), bytes};
  // Built whole, then sliced (tp > 1 without model.sharded_init); else this rank's slices only.
  const double built_whole = t > 1 && !builds_sharded(cfg) ? 4 * whole : m.P;
  m.host_item = {head + bytes_text(built_whole) + " in host memory, where it is built before it moves to the GPU",
                 culprit_of(keys), built_whole};
  if (builds_sharded(cfg) && placement.shards_parameters()) {
    // Built as this rank's shards (models/deferred_init.h): its shard, and the largest tensor
    // made whole at a time: a transformer's token embedding; an image model's largest layer,
    // twice (the whole value, and the layer it is rebuilt from).
    const double classes = static_cast<double>(cfg.model.num_classes);
    const double largest =
        shape.name == "mlp" ? 2.0 * std::max(std::max(kImageFeatures, shape.width) * shape.width, shape.width * classes)
        : shape.name == "cnn" ? 2.0 * std::max(64.0 * 7 * 7 * 128, 128 * classes)
                              : static_cast<double>(k.vocab.effective) * k.width.effective / t;
    const double built = m.P_held + 4 * largest;
    m.host_item = {head + bytes_text(built) + " in host memory while it is built as this rank's shards",
                   culprit_of(keys), built};
  }
  return m;
}

// One training micro-batch's activations of `batch` samples: what is saved for backward, at
// least. Under autocast, 2 bytes per value.
MemoryItem activation_memory(const Config& cfg, const std::optional<Shape>& shape, double batch,
                             const EstimateKeys& k) {
  const double ab = cfg.amp.dtype == AmpDtype::Off ? 4 : 2;
  double A = 0;
  std::vector<KeyUse> keys;
  if (shape && shape->name == "mlp") {
    // The input, each hidden ReLU's output, the logits and their log-softmax.
    A = batch * (kImageFeatures + shape->depth * shape->width + 2 * static_cast<double>(cfg.model.num_classes)) * ab;
    keys = {k.batch, k.width, k.depth, k.classes};
  } else if (shape && shape->name == "cnn") {
    // The input, conv1's ReLU (32 x 28 x 28), pool 1 (32 x 14 x 14), conv2's ReLU (64 x 14 x 14),
    // pool 2 (64 x 7 x 7), fc1's ReLU (128), the logits and their log-softmax.
    A = batch * (784 + 25088 + 6272 + 12544 + 3136 + 128 + 2 * static_cast<double>(cfg.model.num_classes)) * ab;
    keys = {k.batch, k.classes};
  } else if (shape && shape->sequence()) {
    // Per block: the attention probabilities (batch x heads x T x T, saved by softmax) and the
    // causal mask (T x T bool, saved by masked_fill), 16 x width values per token (the inputs
    // of the layer norms and linear layers, q/k/v, GELU's input); one more T x T score tensor
    // while the last block's softmax is made; the final layer norm; the logits and their
    // log-softmax (T x vocab per sample).
    // Under parallel.tp = t (docs/parallel.md) a rank keeps 1/t of what lies inside the regions:
    // its heads' probabilities, 12 of the 16 values per token (q, k, v, the attention's output,
    // the MLP's two hidden tensors) and its vocabulary columns of the logits; the 4 between the
    // regions (each norm's input and output) and the final norm whole, or 1/t of them with
    // sequence parallelism.
    const double T = static_cast<double>(cfg.model.context), d = shape->width, L = shape->depth;
    const double H = static_cast<double>(k.heads.effective), V = static_cast<double>(k.vocab.effective);
    const double t = static_cast<double>(std::max<int64_t>(1, cfg.parallel.tp));
    const double between = cfg.parallel.sequence_parallel ? t : 1;
    // gpt2 and llama attend with scaled_dot_product_attention, whose fused kernels keep no T x T
    // probabilities: for them only what every path saves (a lower bound, as the whole estimate).
    const double scores = shape->hf ? 0 : L * (batch * H * T * T * ab / t + T * T) + batch * H * T * T * ab / t;
    A = scores + batch * T * (12 * L * d / t + (4 * L * d + 2 * d) / between) * ab + 2 * batch * T * V * ab / t;
    keys = {k.batch, k.context, k.heads, k.depth, k.width, k.vocab};
  }
  if (A <= 0) return {};
  return {
      keys_text(keys) + " need " + bytes_text(A) + " of activations for one micro-batch (saved for the backward pass)",
      culprit_of(keys), A};
}

// The synthetic dataset (data/datasets.cpp, make_synthetic): a train split of
// data.synthetic_size samples and a test split of a quarter of it, made one after the other;
// then the sampler's order of an epoch (a permutation and its copy, int64).
struct DataMemory {
  double build = 0, kept = 0, sampler = 0;
  MemoryItem item;
};

DataMemory synthetic_data_memory(const Config& cfg, const std::optional<Shape>& shape, const EstimateKeys& k) {
  DataMemory m;
  if (cfg.data.name != "synthetic" || !shape) return m;
  const double n = static_cast<double>(cfg.data.synthetic_size);
  const double n_test = std::max(1.0, std::floor(n / 4));
  std::vector<KeyUse> keys = {k.size};
  std::string text;
  if (shape->sequence()) {
    // A start and a stride per sequence (int64).
    m.kept = (n + n_test) * 16;
    m.build = m.kept;
    text = "sequences of 16 bytes";
  } else {
    // Images (1, 28, 28) float32 and int64 labels; the labels are the argmax of x @ rule,
    // rule (784 x classes) float32, over a (count x classes) float32 product.
    const double C = static_cast<double>(cfg.model.num_classes), f = kImageFeatures;
    const double rule = f * C * 4;
    m.kept = (n + n_test) * (f * 4 + 8);
    m.build = std::max(rule + n * f * 4 + n * C * 4, rule + n * (f * 4 + 8) + n_test * f * 4 + n_test * C * 4);
    text = "images of " + count_text(f * 4) + " bytes, labelled through a 784 x " +
           std::to_string(cfg.model.num_classes) + " float matrix";
    keys.push_back(k.classes);
  }
  m.sampler = 16 * n;
  const double bytes = std::max(m.build, m.kept + m.sampler);
  m.item = {keys_text(keys) + (keys.size() > 1 ? " make" : " makes") + " synthetic data of " + bytes_text(bytes) +
                " (" + count_text(n) + " train + " + count_text(n_test) + " test " + text +
                ", and the sampler's order of an epoch)",
            culprit_of(keys), bytes};
  return m;
}

MemoryEstimate estimate_memory(const Config& cfg, int64_t dp_size, bool on_cuda) {
  MemoryEstimate e;
  const auto shape = builtin_shape(cfg.model);
  const auto params = estimate_parameters(cfg.model);
  dp_size = std::max<int64_t>(1, dp_size);
  const EstimateKeys k = estimate_keys(cfg, shape);
  ModelMemory model;
  if (params) {
    e.parameters = *params;
    model = model_memory(cfg, dp_size, *shape, *params, k);
    e.model_bytes = model.P_held + model.G + model.S;
  }
  // Samples in a micro-batch: the whole batch with drop_last (the sampler refuses fewer
  // samples than one global batch); without it, at most the rank's share of a synthetic
  // split, and 1 for data whose size is not known here.
  double batch = static_cast<double>(cfg.train.batch_size);
  if (!cfg.data.drop_last)
    batch =
        cfg.data.name == "synthetic"
            ? std::min(batch, std::ceil(static_cast<double>(cfg.data.synthetic_size) / static_cast<double>(dp_size)))
            : 1;
  const MemoryItem act = activation_memory(cfg, shape, batch, k);
  const double A = act.bytes;
  e.activation_bytes = A;
  const DataMemory data = synthetic_data_memory(cfg, shape, k);
  e.data_bytes = std::max(data.build, data.kept + data.sampler);

  // The phases of a run, in order; each is a sum of what is alive at once.
  //  build: the model (built on the CPU) while the data are made;
  //  sample: the kept data and the sampler's order (on a GPU the model has moved there);
  //  step: from the second step on, parameters, gradients (zeroed, kept), optimizer state and
  //  a micro-batch's activations (and on the CPU the data); a one-step run has its activations
  //  or its gradients and optimizer state at their peak, not both.
  const double P = model.P_held, G = model.G, S = model.S;
  const bool several_steps = cfg.train.epochs == 0 && cfg.train.steps >= 2;
  const double state_and_activations = several_steps ? P + G + S + A : P + std::max(A, G + S);
  double host = model.host_item.bytes + data.build;  // built whole (or as its shards: model.sharded_init)
  if (on_cuda) {
    host = std::max(host, data.kept + data.sampler);
    e.device_bytes = state_and_activations;
  } else {
    host = std::max(host, model.host_item.bytes + data.kept + data.sampler);
    host = std::max(host, state_and_activations + data.kept);
  }
  e.host_bytes = host;

  auto add = [](std::vector<MemoryItem>& to, const MemoryItem& it) {
    if (it.bytes > 0) to.push_back(it);
  };
  if (on_cuda) {
    add(e.items, model.host_item);
    add(e.items, data.item);
    add(e.device_items, model.item);
    add(e.device_items, act);
  } else {
    add(e.items, model.item);
    add(e.items, act);
    add(e.items, data.item);
  }
  auto largest_first = [](const MemoryItem& a, const MemoryItem& b) { return a.bytes > b.bytes; };
  std::stable_sort(e.items.begin(), e.items.end(), largest_first);
  std::stable_sort(e.device_items.begin(), e.device_items.end(), largest_first);
  return e;
}

bool builds_sharded(const Config& cfg) {
  return cfg.model.sharded_init && (cfg.parallel.tp > 1 || dist::Placement(cfg.dist.zero).shards_parameters()) &&
         models::builds_deferred(cfg.model.name);
}

double peak_resident_mib() {
  rusage ru{};
  return ::getrusage(RUSAGE_SELF, &ru) == 0 ? static_cast<double>(ru.ru_maxrss) / 1024.0 : 0.0;  // KiB on Linux
}

std::optional<double> available_memory_bytes() {
  double avail = -1, swap = 0;
  {
    std::ifstream in("/proc/meminfo");
    std::string line;
    while (std::getline(in, line)) {
      double kb = 0;
      if (std::sscanf(line.c_str(), "MemAvailable: %lf kB", &kb) == 1)
        avail = kb * 1024;
      else if (std::sscanf(line.c_str(), "SwapFree: %lf kB", &kb) == 1)
        swap = kb * 1024;
    }
  }
  if (avail < 0) {  // no /proc: all of the physical memory, an upper bound
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return std::nullopt;
    avail = static_cast<double>(pages) * static_cast<double>(page);
  }
  // A container's limit (cgroup v2, then v1; "max" or an absurd number means none). The limit
  // itself, not what is left under it: the page cache it counts can be reclaimed.
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    double limit = 0;
    if (f >> limit && limit > 0) avail = std::min(avail, limit);
  }
  return avail + swap;
}

std::optional<double> device_free_bytes(int index) {
  if (index < 0) return std::nullopt;
  try {
    // The CUDA allocator of LibTorch (libc10_cuda) answers with cudaMemGetInfo; a CPU-only
    // LibTorch has none and throws.
    c10::DeviceAllocator* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    const std::pair<size_t, size_t> free_total = allocator->getMemoryInfo(static_cast<c10::DeviceIndex>(index));
    return static_cast<double>(free_total.first);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

namespace {

// "config: <the parts, largest first>. This run needs at least <need> of <where> but
// <available>; lower <key>". Parts under 1% of the largest are left out.
std::string compose(const std::vector<MemoryItem>& items, double need, const std::string& where,
                    const std::string& per_rank, const std::string& available) {
  std::string parts;
  for (const auto& it : items)
    if (it.bytes >= 0.01 * items.front().bytes) parts += (parts.empty() ? "" : "; ") + it.text;
  return "config: " + parts + ". This run needs at least " + bytes_text(need) + " of " + where + per_rank + " but " +
         available + "; lower " + items.front().culprit;
}

}  // namespace

std::string memory_problem(const Config& cfg, int64_t dp_size, int64_t ranks_on_host, bool on_cuda,
                           double available_bytes, std::optional<double> device_available_bytes) {
  const MemoryEstimate e = estimate_memory(cfg, dp_size, on_cuda);
  ranks_on_host = std::max<int64_t>(1, ranks_on_host);
  const double need = e.host_bytes * static_cast<double>(ranks_on_host);
  if (!e.items.empty() && need > available_bytes) {
    std::string per_rank;
    if (ranks_on_host > 1)
      per_rank =
          " (" + bytes_text(e.host_bytes) + " per rank x " + std::to_string(ranks_on_host) + " ranks on this host)";
    return compose(e.items, need, "memory", per_rank,
                   bytes_text(available_bytes) + " is available (MemAvailable + SwapFree)");
  }
  if (on_cuda && device_available_bytes && !e.device_items.empty() && e.device_bytes > *device_available_bytes)
    return compose(e.device_items, e.device_bytes, "GPU memory", "",
                   bytes_text(*device_available_bytes) + " is free on this rank's GPU");
  return "";
}

void check_memory(const Config& cfg, int64_t dp_size, int64_t ranks_on_host, bool on_cuda, int device_index) {
  const auto available = available_memory_bytes();
  if (!available) return;
  const std::optional<double> device = on_cuda ? device_free_bytes(device_index) : std::nullopt;
  const std::string problem = memory_problem(cfg, dp_size, ranks_on_host, on_cuda, *available, device);
  if (!problem.empty()) throw InputError(problem);
}

}  // namespace keel
