// The config schema: every key with its type, doc, range and choices. The defaults live in the
// section structs next to their owners; each key's doc is written here only, and is what
// `keel train --help`, the resolved config.toml and docs/config.md show. A choice is parsed
// into its enum here, once (the names come from the enum's table, common/choices.h).
#include <limits>
#include <stdexcept>

#include "dist/pipeline/schedule.h"
#include "keel/trainer/config/config.h"

namespace keel {
namespace {

template <class T>
struct TypeOf;
template <>
struct TypeOf<bool> {
  static constexpr FieldType value = FieldType::Bool;
};
template <>
struct TypeOf<int64_t> {
  static constexpr FieldType value = FieldType::Int;
};
template <>
struct TypeOf<double> {
  static constexpr FieldType value = FieldType::Float;
};
template <>
struct TypeOf<std::string> {
  static constexpr FieldType value = FieldType::String;
};
template <>
struct TypeOf<std::vector<std::string>> {
  static constexpr FieldType value = FieldType::StringList;
};

class SchemaBuilder {
 public:
  explicit SchemaBuilder(std::vector<FieldInfo>& out) : out_(out) {}

  template <class Sec, class T>
  FieldInfo& add(const char* section, Sec Config::*sec, const char* key, T Sec::*member, const char* doc) {
    FieldInfo f;
    f.section = section;
    f.key = key;
    f.type = TypeOf<T>::value;
    f.doc = doc;
    f.set = [sec, member](Config& c, const Value& v) {
      if constexpr (std::is_same_v<T, double>) {
        // Integers are accepted for float keys (TOML `lr = 1` is a plain mistake to refuse).
        if (auto* i = std::get_if<int64_t>(&v)) {
          (c.*sec).*member = static_cast<double>(*i);
          return;
        }
      }
      (c.*sec).*member = std::get<T>(v);
    };
    f.get = [sec, member](const Config& c) -> Value { return (c.*sec).*member; };
    out_.push_back(std::move(f));
    return out_.back();
  }

  /// A choice: a String key in TOML and on the command line, an enum in the struct.
  template <class Sec, class E, std::size_t N>
  FieldInfo& add(const char* section, Sec Config::*sec, const char* key, E Sec::*member, const Choices<E, N>& table,
                 const char* doc) {
    FieldInfo f;
    f.section = section;
    f.key = key;
    f.type = FieldType::String;
    f.doc = doc;
    for (const auto& c : table) f.choices.push_back(c.name);
    f.set = [sec, member, table, dotted = f.dotted()](Config& c, const Value& v) {
      if (!parse_choice(table, std::get<std::string>(v), (c.*sec).*member))
        throw std::logic_error(dotted + ": a value the schema's choices let through");
    };
    f.get = [sec, member, table](const Config& c) -> Value {
      return std::string(choice_name(table, (c.*sec).*member));
    };
    out_.push_back(std::move(f));
    return out_.back();
  }

 private:
  std::vector<FieldInfo>& out_;
};

FieldInfo& range(FieldInfo& f, double lo, double hi = std::numeric_limits<double>::infinity()) {
  f.has_min = true;
  f.min = lo;
  if (hi != std::numeric_limits<double>::infinity()) {
    f.has_max = true;
    f.max = hi;
  }
  return f;
}

// [lo, hi): hi itself is refused (torch's AdamW needs 0 <= beta < 1).
FieldInfo& range_below(FieldInfo& f, double lo, double hi) {
  range(f, lo, hi);
  f.max_exclusive = true;
  return f;
}

// [run]
void run_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("run", &C::run, "name", &RunConfig::name, "run name, used in logs and the default run.dir");
  b.add("run", &C::run, "dir", &RunConfig::dir, "output directory (metrics, summary, config); \"\" = runs/<run.name>");
  b.add("run", &C::run, "seed", &RunConfig::seed, "seed for model init, data order and synthetic data");
  b.add("run", &C::run, "count_tensor_memory", &RunConfig::count_tensor_memory,
        "count the bytes of live CPU tensors exactly (a counting allocator in place of LibTorch's CPU allocator, "
        "from the start of the run): summary.json's cpu_tensor_peak_mb and cpu_tensor_end_mb; for measurements "
        "(peak RSS also counts memory the C library keeps after it is freed)");
  range(b.add("run", &C::run, "threads", &RunConfig::threads, "intra-op threads per rank; 0 = cores / local ranks"), 0,
        1024);
  b.add("run", &C::run, "device", &RunConfig::device, kDeviceChoices,
        "auto | cpu | cuda (auto: cuda:<local_rank> in CUDA builds with a GPU, else cpu)");
  b.add("run", &C::run, "log_level", &RunConfig::log_level, kLogLevels,
        "log level of rank 0 (other ranks log warnings unless run.all_ranks_log)");
  b.add("run", &C::run, "all_ranks_log", &RunConfig::all_ranks_log, "log at run.log_level on every rank");
  b.add("run", &C::run, "progress", &RunConfig::progress,
        "one-line progress display (step, loss, it/s, ETA) when stdout is a terminal");
  b.add("run", &C::run, "tensorboard", &RunConfig::tensorboard,
        "rank 0 writes TensorBoard event files under <run.dir>/tb/: train loss, lr, step time, throughput, loss scale, "
        "skipped steps, grad norm, MFU, per-rank step-time spread, eval loss and accuracy");
  b.add("run", &C::run, "sync_debug", &RunConfig::sync_debug, kSyncDebugModes,
        "CUDA's sync debug mode (torch.cuda.set_sync_debug_mode) over the steady steps, from step 6 on: warn = a "
        "warning for each operation that makes the host wait for the GPU, error = such an operation fails the run "
        "(naming it); evaluation, checkpoints and the last step are exempt. A check that the step keeps the GPU fed "
        "(dist.consensus = late); CUDA only, off on the CPU");
  b.add("run", &C::run, "profile_steps", &RunConfig::profile_steps,
        "\"A-B\": record optimizer steps A to B with LibTorch's profiler on every rank into "
        "<run.dir>/trace.rank<R>.json (Chrome trace: Perfetto, chrome://tracing); \"\" = off");
  range(b.add("run", &C::run, "peak_tflops", &RunConfig::peak_tflops,
              "peak TFLOP/s of one rank's device, the denominator of MFU in the log and summary.json; 0 = measured at "
              "start with a short matrix multiply (for models that report their FLOPs: gpt, mlp)"),
        0.0, 1e9);
}

// [model]
void model_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("model", &C::model, "name", &ModelConfig::name,
        "model: mlp | cnn | gpt | gpt2 | llama (Hugging Face GPT-2 and Llama causal language models, the "
        "same tensor names; sizes from model.init_from's config.json or the [model] keys) | torchscript | python (a "
        "PyTorch module, compiled: compile.mode = inductor) | a "
        "registered name");
  b.add("model", &C::model, "path", &ModelConfig::path,
        "the file of a user's model: a TorchScript file (model.name = torchscript) or a Python file defining "
        "model.factory (model.name = python)");
  b.add("model", &C::model, "factory", &ModelConfig::factory,
        "model.name = python: the function in model.path that returns the nn.Module; it may take config (the "
        "[model] section as a dict)");
  range(b.add("model", &C::model, "width", &ModelConfig::width,
              "hidden width; 0 = the model's default (mlp 256, gpt 256)"),
        0, 1 << 20);
  range(b.add("model", &C::model, "depth", &ModelConfig::depth,
              "hidden layers (mlp, default 8) or transformer blocks (gpt, default 4); 0 = default"),
        0, 4096);
  range(b.add("model", &C::model, "heads", &ModelConfig::heads, "attention heads (gpt); must divide the width"), 1,
        4096);
  range(b.add("model", &C::model, "context", &ModelConfig::context, "tokens per sequence (gpt and text data)"), 1,
        1 << 20);
  range(b.add("model", &C::model, "vocab", &ModelConfig::vocab, "vocabulary size (gpt; byte-level = 256)"), 2, 1 << 24);
  b.add("model", &C::model, "input", &ModelConfig::input, kModelInputs,
        "input kind of a torchscript or python model: auto (from the data) | image | tokens");
  b.add("model", &C::model, "init_from", &ModelConfig::init_from,
        "safetensors weights to start from: a .safetensors file (e.g. PyTorch's safetensors.torch.save_file), a "
        "model.safetensors.index.json, or a directory holding either (a keel checkpoint step); every parameter and "
        "buffer by name and shape, nothing else; a resumed checkpoint overrides it");
  range(b.add("model", &C::model, "num_classes", &ModelConfig::num_classes, "output classes of image models"), 2,
        1 << 24);
  range(b.add("model", &C::model, "kv_heads", &ModelConfig::kv_heads,
              "llama: key/value heads of grouped-query attention (num_key_value_heads); must divide model.heads; 0 "
              "= model.heads"),
        0, 4096);
  range(b.add("model", &C::model, "ffn_width", &ModelConfig::ffn_width,
              "gpt2, llama: the MLP's inner width (n_inner, intermediate_size); 0 = the family's default (gpt2 4 x "
              "width, llama 8/3 x width rounded up to a multiple of 64)"),
        0, 1 << 22);
  range(b.add("model", &C::model, "rope_theta", &ModelConfig::rope_theta,
              "llama: the base of the rotary position embedding (rope_theta)"),
        1.0, 1e12);
  range(b.add("model", &C::model, "dropout", &ModelConfig::dropout,
              "gpt, gpt2, llama: dropout probability while training (gpt, gpt2: after the embeddings, on the "
              "attention weights and after each residual branch; llama: on the attention weights, as "
              "transformers); -1 = init_from's config.json's (gpt2 embd_pdrop, attn_pdrop, resid_pdrop; llama "
              "attention_dropout), else 0"),
        -1.0, 0.95);
  range(b.add("model", &C::model, "norm_eps", &ModelConfig::norm_eps,
              "gpt2, llama: the epsilon of LayerNorm (layer_norm_epsilon) or RMSNorm (rms_norm_eps); 0 = the "
              "family's default (gpt2 1e-5, llama 1e-6)"),
        0.0, 1.0);
  b.add("model", &C::model, "tie_embeddings", &ModelConfig::tie_embeddings,
        "gpt2, llama: the output projection is the token embedding (tie_word_embeddings); false = an lm_head of "
        "its own");
  b.add("model", &C::model, "sharded_init", &ModelConfig::sharded_init,
        "gpt, gpt2, llama at dist.zero = 3 or parallel.tp > 1, mlp and cnn at dist.zero = 3: build the model as "
        "this rank's shards only (no "
        "rank holds it whole; the parameters equal the unsharded build's from run.seed bit for bit, and "
        "model.init_from reads this rank's slices); false = every rank builds the whole model first");
}

// [data]
void data_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("data", &C::data, "name", &DataConfig::name,
        "dataset: fashion_mnist | text | tokens | synthetic | a registered name");
  b.add("data", &C::data, "path", &DataConfig::path,
        "dataset location; \"\" = default (fashion_mnist: /usr/share/datasets/fashion-mnist); tokens: a token "
        "file or a glob of shards (data/fineweb_train_*.bin), read in place");
  b.add("data", &C::data, "drop_last", &DataConfig::drop_last,
        "drop each epoch's incomplete last batch (keeps shapes static)");
  b.add("data", &C::data, "shuffle", &DataConfig::shuffle,
        "reshuffle the train split every epoch from (run.seed, epoch)");
  range(b.add("data", &C::data, "eval_batch_size", &DataConfig::eval_batch_size, "per-rank batch size for evaluation"),
        1, 1 << 24);
  range(b.add("data", &C::data, "synthetic_size", &DataConfig::synthetic_size,
              "samples in the synthetic train split (test split: a quarter of it)"),
        1, 1 << 28);
  range(b.add("data", &C::data, "test_fraction", &DataConfig::test_fraction,
              "text, and tokens without data.test_path: fraction of the data (its tail) held out for evaluation"),
        0.0, 0.9);
  range(b.add("data", &C::data, "eval_samples", &DataConfig::eval_samples,
              "test-split samples each evaluation uses, the first ones (a large token corpus); 0 = all"),
        0, 1e12);
  b.add("data", &C::data, "token_dtype", &DataConfig::token_dtype, kTokenDtypes,
        "tokens: auto = an llm.c .bin file (256-int32 header; magic 20240520: uint16 tokens, 20240801: uint32); "
        "uint16 | uint32 = raw little-endian tokens, no header");
  b.add("data", &C::data, "test_path", &DataConfig::test_path,
        "tokens: the held-out token file(s), a file or a glob; \"\" = data.path's tail (data.test_fraction)");
}

// [train]
void train_keys(SchemaBuilder& b) {
  using C = Config;
  range(b.add("train", &C::train, "steps", &TrainConfig::steps, "optimizer steps to run; train.epochs > 0 replaces it"),
        1, 1e12);
  range(b.add("train", &C::train, "epochs", &TrainConfig::epochs, "epochs over the train split; 0 = use train.steps"),
        0, 1e9);
  range(b.add("train", &C::train, "batch_size", &TrainConfig::batch_size, "samples per rank per micro-batch"), 1,
        1 << 24);
  range(b.add("train", &C::train, "grad_accum", &TrainConfig::grad_accum,
              "micro-batches per optimizer step (gradient accumulation)"),
        1, 1 << 20);
  b.add("train", &C::train, "optimizer", &TrainConfig::optimizer,
        "optimizer: adamw | sgd (fused kernels unless train.fused_optimizer = false) | a name registered with "
        "keel::register_optimizer");
  range(b.add("train", &C::train, "lr", &TrainConfig::lr, "peak learning rate"), 0.0, 1e6);
  range(b.add("train", &C::train, "min_lr", &TrainConfig::min_lr, "learning rate at the end of the cosine schedule"),
        0.0, 1e6);
  range(b.add("train", &C::train, "weight_decay", &TrainConfig::weight_decay,
              "weight decay (decoupled for adamw, L2 for sgd)"),
        0.0, 1e6);
  range(b.add("train", &C::train, "momentum", &TrainConfig::momentum, "sgd momentum; 0 = plain sgd"), 0.0, 1.0);
  range_below(
      b.add("train", &C::train, "beta1", &TrainConfig::beta1,
            "adamw beta1, the decay of the gradients' running average: 0 <= beta1 < 1 (torch's AdamW refuses 1)"),
      0.0, 1.0);
  range_below(
      b.add(
          "train", &C::train, "beta2", &TrainConfig::beta2,
          "adamw beta2, the decay of the squared gradients' running average: 0 <= beta2 < 1 (torch's AdamW refuses 1)"),
      0.0, 1.0);
  range(b.add("train", &C::train, "eps", &TrainConfig::eps, "adamw epsilon"), 0.0, 1.0);
  range(b.add("train", &C::train, "warmup_steps", &TrainConfig::warmup_steps,
              "linear warmup from 0 to train.lr, in steps"),
        0, 1e12);
  b.add("train", &C::train, "schedule", &TrainConfig::schedule,
        "learning-rate schedule: cosine (warmup, then to train.min_lr) | constant (warmup, then train.lr) | a name "
        "registered with keel::register_schedule");
  b.add("train", &C::train, "loss", &TrainConfig::loss,
        "training (and evaluation) loss: cross_entropy (over the last dimension; evaluation also reports top-1 "
        "accuracy) | a name registered with keel::register_loss");
  b.add("train", &C::train, "ignore_index", &TrainConfig::ignore_index,
        "cross_entropy: targets equal to it add nothing to the loss, its gradient or the evaluation (PyTorch's "
        "ignore_index, Hugging Face's -100 for unlabelled tokens); a micro-batch with no other target has loss 0 "
        "(PyTorch: NaN). Any other target outside [0, classes) is refused (exit 2)");
  range(b.add("train", &C::train, "grad_clip", &TrainConfig::grad_clip, "max global gradient L2 norm; 0 = no clipping"),
        0.0, 1e12);
  range(b.add("train", &C::train, "eval_interval", &TrainConfig::eval_interval,
              "steps between evaluations on the test split; 0 = never, otherwise also after the last step"),
        0, 1e12);
  range(b.add("train", &C::train, "log_interval", &TrainConfig::log_interval,
              "steps between log lines (metrics.jsonl records every step)"),
        1, 1e12);
  b.add("train", &C::train, "skip_nonfinite", &TrainConfig::skip_nonfinite,
        "skip, on every rank, a step whose gradients hold inf/NaN (default: stop with an error)");
  b.add("train", &C::train, "grads_to_none", &TrainConfig::grads_to_none,
        "before a step, free the gradients that no DDP bucket or ZeRO shard holds (as PyTorch's "
        "zero_grad(set_to_none=True)), so that a step holds no gradient memory until its backward makes it; a "
        "parameter that then gets no gradient in a step is not updated by it (no decay, no momentum), as in "
        "PyTorch. false: they are zeroed and kept. (Gradients that are views of DDP's buckets, whenever a Reducer "
        "runs: dist.zero 0-1 at dp > 1, or at one rank with dist.backend named, and ZeRO-2/3's shards are always "
        "zeroed, so there a parameter without a gradient is still updated, as under PyTorch's DDP)");
  b.add("train", &C::train, "fused_optimizer", &TrainConfig::fused_optimizer,
        "update every parameter with one fused ATen kernel (at::_fused_adamw_ / at::_fused_sgd_, as PyTorch's "
        "fused=True; CPU and CUDA); false: torch::optim's per-parameter loop. The checkpointed state is the same "
        "either way");
  b.add("train", &C::train, "activation_checkpointing", &TrainConfig::activation_checkpointing,
        kActivationCheckpointing,
        "none | blocks: every transformer block (gpt, gpt2, llama) keeps only its input in the forward and "
        "recomputes its activations in backward, with the forward's dropout masks and autocast dtypes, so training "
        "is the same bit for bit with less activation memory and one more forward per block; with every "
        "dist.zero and parallel.tp, compile.mode = \"off\" (and not with dist.find_unused_parameters at dist.zero <= "
        "1) | selective: as blocks, but each block also keeps its dense projections' outputs (every "
        "matmul by a weight) and its backward recomputes everything else (norms, activations, attention, "
        "dropout, tp collectives) from them: the same training bit for bit, more memory than blocks and less "
        "recomputation");
}

// [dist]
void dist_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("dist", &C::dist, "backend", &DistConfig::backend, kBackends,
        "process-group backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl");
  range(b.add("dist", &C::dist, "timeout_s", &DistConfig::timeout_s,
              "bound on rendezvous and on every collective, seconds"),
        1, 86400 * 7);
  range(b.add("dist", &C::dist, "bucket_cap_mb", &DistConfig::bucket_cap_mb, "DDP gradient bucket size, MiB"), 0.0,
        1e6);
  range(b.add("dist", &C::dist, "first_bucket_mb", &DistConfig::first_bucket_mb,
              "size of DDP's first bucket (the gradients ready first), MiB"),
        0.0, 1e6);
  b.add("dist", &C::dist, "find_unused_parameters", &DistConfig::find_unused_parameters,
        "tolerate parameters that receive no gradient in a step (on some ranks or all; with dist.zero >= 2 every "
        "block's gradients are then reduced after the backward, in order, instead of as each block completes)");
  b.add("dist", &C::dist, "broadcast_buffers", &DistConfig::broadcast_buffers,
        "rank 0's buffers (BatchNorm running statistics, ...) reach every rank before each forward, each evaluation, "
        "each checkpoint and the end (PyTorch DDP's broadcast_buffers); false: each rank keeps its own");
  b.add("dist", &C::dist, "comm_hook", &DistConfig::comm_hook, kCommHooks,
        "gradient all-reduce: allreduce | bf16 | fp16 (compressed)");
  b.add("dist", &C::dist, "interface", &DistConfig::interface,
        "network interface(s) the backend uses, comma-separated (e.g. \"eth0\"; NCCL_SOCKET_IFNAME too unless set); "
        "\"\" = GLOO_SOCKET_IFNAME if set, else the interface that routes to the rendezvous host");
  range(b.add("dist", &C::dist, "flight_recorder", &DistConfig::flight_recorder,
              "the flight recorder: each rank keeps its last N collectives, messages and gradient buckets (group, "
              "sequence number, op, dtype, shape, phase of the step, times, state) and writes them to "
              "<run.dir>/flight/rank<R>.json when the run fails, times out, is signalled (SIGUSR1: dump and go on) or "
              "stalls; `keel doctor RUN_DIR` reads them (docs/faults.md); 0 = off"),
        0, 10000000);
  b.add("dist", &C::dist, "validate", &DistConfig::validate, kValidateModes,
        "cross-rank check of every collective (op, dtype, shape): always | first_step | off");
  b.add("dist", &C::dist, "consensus", &DistConfig::consensus, kConsensusModes,
        "when the host reads the per-step consensus (mean loss, the inf/NaN verdict, each rank's step and gradient "
        "plan): step = at the end of each step's backward, before the update (the host waits for the device every "
        "step); late = one step later, while the next step runs: the verdict stays on the device as the fused "
        "optimizer's and the GradScaler's found_inf (no rank applies an update some rank found inf/NaN in, or "
        "disagrees on), so a steady step never waits for the device; log lines and metrics follow one step behind, and "
        "a stop request takes effect one step later (needs train.fused_optimizer); auto = late on CUDA with NCCL and "
        "train.fused_optimizer, step otherwise");
  range(
      b.add("dist", &C::dist, "zero", &DistConfig::zero,
            "ZeRO stage (docs/zero.md): 0 = every rank holds the whole optimizer state (DDP); 1 = the optimizer state "
            "is partitioned by parameter across ranks, each rank updates its own parameters and broadcasts them; 2 = "
            "the gradients and optimizer state are sharded (each block's gradients reduce-scattered as its backward "
            "completes, a rank keeping 1/world of them (1/parallel.dp under tensor parallelism); the updated shards "
            "all-gathered after the step); 3 = the "
            "parameters are sharded too (each block gathered before it runs and freed after, its gradients "
            "reduce-scattered: FSDP2 / ZeRO-3), a rank holding 1/world (1/parallel.dp under tensor parallelism) of the "
            "parameters, gradients and optimizer "
            "state between steps"),
      0, 3);
}

// [parallel]
void parallel_keys(SchemaBuilder& b) {
  using C = Config;
  range(b.add("parallel", &C::parallel, "dp", &ParallelConfig::dp,
              "data-parallel degree: the ranks that split the batch (DDP, dist.zero); 0 = world size / (parallel.pp x "
              "parallel.tp)"),
        0, 1 << 20);
  range(b.add("parallel", &C::parallel, "tp", &ParallelConfig::tp,
              "tensor-parallel degree (Megatron's layout, docs/architecture.md): each block's attention heads and MLP, "
              "the token embedding and the output projection split over tp ranks, which read the same batch; "
              "parallel.dp x parallel.tp = the world size; DDP or dist.zero 1-3 over the dp ranks (ZeRO shards the tp "
              "shards). Models gpt, gpt2 and llama; dropout masks are shared by the tp ranks where they hold a tensor "
              "whole and each rank's own where it holds a part (its heads; with sequence parallelism its positions). "
              "Eager, or with compile.mode = \"inductor\" (each block's regions between its collectives packaged: "
              "compile.granularity); no custom loss or run.sync_debug (each refused by name); "
              "checkpoints hold whole tensors, as at tp = 1, and resume at any parallel.tp and dist.zero"),
        1, 1 << 20);
  b.add("parallel", &C::parallel, "sequence_parallel", &ParallelConfig::sequence_parallel,
        "with parallel.tp > 1 (no effect at tp = 1): the norms, dropout and residual adds between the "
        "tensor-parallel regions run on model.context / tp positions per rank (all-gather into each region, "
        "reduce-scatter out of it, instead of an all-reduce), so activations outside the regions take 1/tp of the "
        "memory (Megatron's sequence parallelism); model.context must divide by tp");
  range(b.add("parallel", &C::parallel, "pp", &ParallelConfig::pp,
              "pipeline-parallel degree: the model's blocks split into stages over pp ranks (the embedding on the "
              "first, the final norm, head and loss on the last), each micro-batch (train.grad_accum per step) sent "
              "from stage to stage; parallel.pp x parallel.dp x parallel.tp = the world size. `keel train "
              "--print-schedule` prints which rank runs what when (docs/parallel.md)"),
        1, 1 << 20);
  b.add("parallel", &C::parallel, "pp_split", &ParallelConfig::pp_split,
        "how parallel.pp splits the blocks: \"even\" (about the same number of parameters per stage, the "
        "embedding and head counted on the first and last) or the first block of each stage after the first, "
        "comma-separated and increasing (\"2,4,6\" at pp = 4)");
  FieldInfo& schedule = b.add("parallel", &C::parallel, "pp_schedule", &ParallelConfig::pp_schedule,
                              "the pipeline schedule (PyTorch 2.11's torch.distributed.pipelining): gpipe (every "
                              "forward, then every backward), 1f1b (at most pp micro-batches' activations held; "
                              "train.grad_accum >= pp), interleaved and looped-bfs (parallel.pp_virtual_stages per "
                              "rank), and the zero-bubble family, whose backward is split into input and weight "
                              "gradients: interleaved-zb, zbv and dualpipev (two stages per rank, a V)");
  schedule.choices = dist::pipeline::schedule_names();
  range(b.add("parallel", &C::parallel, "pp_virtual_stages", &ParallelConfig::pp_virtual_stages,
              "stages per pp rank (parallel.pp x this = the stages): 0 = the schedule's own (1 for gpipe and 1f1b, "
              "2 for the others); interleaved, looped-bfs and interleaved-zb take any, zbv and dualpipev 2"),
        0, 64);
}

// [compile]
void compile_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("compile", &C::compile, "mode", &CompileConfig::mode, kCompileModes,
        "off | trace (deprecated: forward as a TorchScript graph) | inductor (compiled ahead of time by Inductor, run "
        "from C++: the whole training step, or each block: compile.granularity; traced from the C++ model trained)");
  b.add(
      "compile", &C::compile, "granularity", &CompileConfig::granularity, kCompileGranularities,
      "inductor: step (the whole training step, one package) | blocks (a transformer block's forward and backward, "
      "one package reused for every block, with the root's embedding, head and loss (eager under parallel.tp > 1); "
      "DDP's buckets overlap the backward, dist.zero = 3 gathers around each block; under parallel.tp > 1 the "
      "block's regions between its collectives; gpt, gpt2, llama and registered models that declare their blocks; "
      "every unit traced from the C++ model; under parallel.pp > 1 each stage runs its blocks from it) | auto (blocks "
      "at dist.zero = 3, parallel.tp > 1 or parallel.pp > 1, else step)");
  b.add("compile", &C::compile, "fullgraph", &CompileConfig::fullgraph,
        "anything that prevents one whole static graph is an error (else: warning, eager fallback)");
  b.add("compile", &C::compile, "deterministic", &CompileConfig::deterministic,
        "non-deterministic ops inside the graph are an error");
  range(b.add("compile", &C::compile, "max_recompiles", &CompileConfig::max_recompiles,
              "shape re-specialisations allowed before it is an error"),
        0, 1 << 20);
  b.add("compile", &C::compile, "cache_dir", &CompileConfig::cache_dir,
        "persistent compile cache directory; \"\" = no cache (trace), ~/.cache/keel/compile (inductor)");
  b.add("compile", &C::compile, "cuda_graphs", &CompileConfig::cuda_graphs,
        "capture the step as CUDA graphs after a warm-up and replay them from static input buffers (CUDA builds, "
        "NCCL, dist.consensus late; a new batch shape is captured anew, counted against compile.max_recompiles)");
  b.add("compile", &C::compile, "cuda_graphs_rehearsal", &CompileConfig::cuda_graphs_rehearsal,
        "with compile.cuda_graphs on run.device = \"cpu\" (any build, Gloo too): the same warm-up, static buffers, "
        "captures and refusals, each replay re-running the captured step: checks a config without a GPU, no speed-up");
  b.add("compile", &C::compile, "max_autotune", &CompileConfig::max_autotune,
        "inductor: autotune kernels while compiling (slower compile, maybe faster steps)");
  b.add("compile", &C::compile, "python", &CompileConfig::python,
        "inductor: the Python of the packaging step (torch 2.11); \"\" = $KEEL_PYTHON, else keel's venv "
        "(~/.cache/keel/venv)");
  b.add("compile", &C::compile, "libraries", &CompileConfig::libraries,
        "inductor: shared libraries (.so) of custom ops registered with TORCH_LIBRARY (each with a fake/Meta "
        "kernel), loaded by keel and by the packaging step, so that the package calls the ops");
}

// [amp]
void amp_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("amp", &C::amp, "dtype", &AmpConfig::dtype, kAmpDtypes, "autocast dtype: off | bf16 | fp16 (fp16: CUDA only)");
  b.add("amp", &C::amp, "loss_scaling", &AmpConfig::loss_scaling, kLossScalings,
        "auto (dynamic for fp16, else off) | dynamic | off");
  range(b.add("amp", &C::amp, "init_scale", &AmpConfig::init_scale, "GradScaler initial scale"), 1e-30, 1e38);
  range(b.add("amp", &C::amp, "growth_factor", &AmpConfig::growth_factor,
              "scale multiplier after amp.growth_interval clean steps"),
        1.0, 1e6);
  range(b.add("amp", &C::amp, "backoff_factor", &AmpConfig::backoff_factor,
              "scale multiplier after a step with inf/NaN gradients"),
        1e-6, 1.0);
  range(b.add("amp", &C::amp, "growth_interval", &AmpConfig::growth_interval, "clean steps between scale growths"), 1,
        1e12);
}

// [checkpoint]
void checkpoint_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("checkpoint", &C::checkpoint, "dir", &CheckpointConfig::dir,
        "checkpoint root directory; \"\" = no checkpoints; a run whose directory holds committed steps resumes from "
        "the newest (docs/checkpoints.md)");
  range(b.add("checkpoint", &C::checkpoint, "interval", &CheckpointConfig::interval,
              "steps between saves; 0 = only the final save"),
        0, 1e12);
  range(b.add("checkpoint", &C::checkpoint, "keep", &CheckpointConfig::keep,
              "committed steps to keep (at least 2 with async saves)"),
        1, 1e6);
  b.add("checkpoint", &C::checkpoint, "async", &CheckpointConfig::async, "write checkpoints in a background thread");
  b.add("checkpoint", &C::checkpoint, "resume_from", &CheckpointConfig::resume_from,
        "step directory or step number to resume from (an error if it does not load); \"\" = the newest committed step "
        "that verifies");
  b.add("checkpoint", &C::checkpoint, "save_graph", &CheckpointConfig::save_graph,
        "also store the compiled graph with each step: compile.mode = \"inductor\": the training step's AOTInductor "
        "package (graph.pt2, with its manifest graph.json; a resume that fits loads it instead of compiling); "
        "\"trace\": the traced TorchScript module (graph.pt)");
}

// [fault]
void fault_keys(SchemaBuilder& b) {
  using C = Config;
  b.add("fault", &C::fault, "inject", &FaultConfig::inject,
        "faults to inject: TYPE@step=S,rank=R[,always][,restart=K][,ms=M][,crash] entries, TYPE one of "
        "collective_hang, crash, oom, nonfinite_grad, shape_mismatch, checkpoint_write_failure, checkpoint_corruption, "
        "graph_break, straggler (docs/faults.md; repeat the option for several)");
}

std::vector<FieldInfo> build_schema() {
  std::vector<FieldInfo> v;
  v.reserve(80);
  SchemaBuilder b(v);
  run_keys(b);
  model_keys(b);
  data_keys(b);
  train_keys(b);
  dist_keys(b);
  parallel_keys(b);
  compile_keys(b);
  amp_keys(b);
  checkpoint_keys(b);
  fault_keys(b);
  return v;
}

}  // namespace

const std::vector<FieldInfo>& config_schema() {
  static const std::vector<FieldInfo> schema = build_schema();
  return schema;
}

const std::vector<std::string>& config_sections() {
  static const std::vector<std::string> sections = {"run",      "model",   "data", "train",      "dist",
                                                    "parallel", "compile", "amp",  "checkpoint", "fault"};
  return sections;
}

const FieldInfo* find_field(const std::string& dotted) {
  for (const auto& f : config_schema()) {
    if (f.dotted() == dotted) return &f;
    for (const auto& a : f.aliases)
      if (f.section + "." + a == dotted) return &f;
  }
  return nullptr;
}

const char* field_type_name(FieldType t) {
  switch (t) {
    case FieldType::Bool:
      return "bool";
    case FieldType::Int:
      return "int";
    case FieldType::Float:
      return "float";
    case FieldType::String:
      return "string";
    case FieldType::StringList:
      return "list of strings";
  }
  return "?";
}

}  // namespace keel
