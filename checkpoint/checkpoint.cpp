#include "checkpoint/checkpointer.h"

#include "checkpoint/meta.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <set>
#include <thread>

#include "common/log.h"

#include "common/clock.h"
#include "common/file.h"
#include "common/text.h"
#include "keel/dist/collectives.h"
#include "keel/version.h"

namespace keel::checkpoint {
namespace {

const char* kMeta = "meta.json";
const char* kIndex = "model.safetensors.index.json";
const char* kOptimizerIndex = "optimizer.safetensors.index.json";
const char* kGraph = "graph.pt";
const char* kPackage = "graph.pt2";
const char* kPackageManifest = "graph.json";
const char* kRankStateKey = "keel.rank_state";

std::string numbered(const char* fmt, int64_t a, int64_t b) {
  char buf[96];
  std::snprintf(buf, sizeof buf, fmt, static_cast<long>(a), static_cast<long>(b));
  return buf;
}

uint64_t nbytes(const torch::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

nlohmann::json read_meta(const std::string& step_dir) {
  return parse_meta(read_metadata(step_dir + "/" + kMeta), step_dir + "/" + kMeta,
                    step_dir.substr(step_dir.find_last_of('/') + 1));
}

// The SHA-256 meta.json records for `name`, after checking that the file has the recorded size
// (so a cut file is reported as truncated, not just as a checksum mismatch).
std::string expected_sha(const nlohmann::json& meta, const std::string& dir, const std::string& name) {
  if (!meta["files"].contains(name))
    throw FormatError(dir + "/" + kMeta + ": does not list " + name + " (incomplete checkpoint)");
  const std::string path = dir + "/" + name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw FormatError(path + ": missing (listed in meta.json)");
  const uint64_t want = meta["files"][name]["bytes"].get<uint64_t>();
  if (static_cast<uint64_t>(st.st_size) != want)
    throw FormatError(path + ": " + std::to_string(st.st_size) + " bytes, meta.json records " + std::to_string(want) +
                      " (truncated or extended after the commit)");
  return meta["files"][name]["sha256"].get<std::string>();
}

// A small file of the step (an index), read whole and checked against meta.json's SHA-256.
std::string read_verified(const nlohmann::json& meta, const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name;
  const std::string want = expected_sha(meta, dir, name);  // the recorded size first: nothing larger is read
  const std::string text = read_metadata(path);
  Sha256 h;
  h.update(text.data(), text.size());
  if (h.hex() != want) throw FormatError(path + ": checksum mismatch");
  return text;
}

}  // namespace

std::string model_file(int64_t rank, int64_t world) {
  return numbered("model-%05ld-of-%05ld.safetensors", rank + 1, world);
}
std::string optimizer_file(int64_t rank, int64_t world) {
  return numbered("optimizer-%05ld-of-%05ld.safetensors", rank + 1, world);
}
std::string extra_file(int64_t rank, int64_t world) {
  return numbered("extra-%05ld-of-%05ld.safetensors", rank + 1, world);
}
std::string rank_file(int64_t rank) { return numbered("rank-%05ld.safetensors", rank, 0); }

std::vector<int64_t> assign_shards(const std::vector<uint64_t>& sizes, int64_t world) {
  std::vector<size_t> order(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  std::vector<uint64_t> load(static_cast<size_t>(world), 0);
  std::vector<int64_t> owner(sizes.size(), 0);
  for (size_t i : order) {
    const size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = static_cast<int64_t>(r);
    load[r] += sizes[i];
  }
  return owner;
}

std::vector<StepInfo> list_steps(const std::string& dir) {
  std::vector<StepInfo> out;
  for (const auto& n : list_dir(dir)) {
    if (n.rfind("step_", 0) != 0 || n.size() == 5) continue;
    const std::string digits = n.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), ::isdigit) || digits.size() > 18) continue;
    StepInfo s;
    s.step = std::stoll(digits);
    s.path = dir + "/" + n;
    // A linked step is not this directory's: never loaded, never rotated away (rotation would
    // delete files where the link points). docs/checkpoints.md.
    if (is_symlink(s.path) || !is_directory(s.path)) continue;
    s.committed = path_exists(s.path + "/" + kMeta);
    out.push_back(s);
  }
  std::sort(out.begin(), out.end(), [](const StepInfo& a, const StepInfo& b) { return a.step < b.step; });
  return out;
}

namespace {
using Wants = std::function<bool(const std::string&)>;
Loaded read_step(const std::string& dir, int64_t rank, const Wants& wants);
}  // namespace

// Every file's checksum (each problem listed), then the loader's own checks (read_step: the
// shard set of the saved world, the index against the shards, each rank's file): what
// `keel inspect` calls verified is exactly what training would load.
std::string optimizer_tensor_problem(const std::string& name, const torch::Tensor& t, bool step_count,
                                     const torch::Tensor& param, int64_t step) {
  const std::string what =
      "optimizer state \"" + name + "\" (" + c10::toString(t.scalar_type()) + c10::str(t.sizes()) + ")";
  if (step_count) {
    if (t.numel() != 1 || !c10::isIntegralType(t.scalar_type(), /*includeBool=*/false))
      return what + " must be a single integer (a step count)";
    const int64_t v = t.reshape({}).item<int64_t>();
    if (v < 0 || v > step) return what + " = " + std::to_string(v) + " is outside [0, " + std::to_string(step) + "]";
  } else if (t.sizes() != param.sizes() || t.scalar_type() != param.scalar_type()) {
    const size_t dot = name.find_last_of('.');
    return what + " does not match its parameter " + name.substr(0, dot) + " (" + c10::toString(param.scalar_type()) +
           c10::str(param.sizes()) + ")";
  }
  return "";
}

std::vector<std::string> verify_step(const std::string& step_dir) {
  nlohmann::json meta;
  try {
    meta = read_meta(step_dir);
  } catch (const std::exception& e) {
    return {e.what()};
  }
  // The loader's own checks first: they checksum every file they read (every listed file but
  // the rank files of ranks other than 0), so those are not hashed twice.
  std::string load_error;
  try {
    const Loaded L = read_step(step_dir, 0, {});
    for (int64_t r = 1; r < L.saved_world_size; ++r) expected_sha(meta, step_dir, rank_file(r));
  } catch (const std::exception& e) {
    load_error = e.what();
  }
  // Then each listed file the loader did not check, or, when it failed, every listed file, so
  // that every damaged file is named and not only the first.
  std::vector<std::string> problems;
  for (auto it = meta["files"].begin(); it != meta["files"].end(); ++it) {
    if (load_error.empty() && (it.key().rfind("rank-", 0) != 0 || it.key() == rank_file(0))) continue;
    const std::string path = step_dir + "/" + it.key();
    try {
      // expected_sha checks presence and size (the same checks a load makes).
      if (sha256_file(path) != expected_sha(meta, step_dir, it.key()))
        problems.push_back(path + ": SHA-256 differs from meta.json (corrupted)");
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  }
  if (problems.empty() && !load_error.empty()) problems.push_back(load_error);
  return problems;
}

// ---------------------------------------------------------------------------------------------

struct Checkpointer::Pending {
  int64_t step = 0;
  std::string dir;
  NamedTensors model_shard, optimizer_shard, extra_shard, rank_tensors;
  bool has_extra = false;
  std::map<std::string, std::string> rank_meta;
  std::string graph, package, package_manifest;
  // Every rank's view of the whole plan (for the index).
  std::vector<std::string> model_names;
  std::vector<int64_t> model_owner;
  uint64_t model_bytes = 0;
  nlohmann::json shared;
  nlohmann::json optimizer_map = nlohmann::json::object();  // rank 0: state tensor -> file
  nlohmann::json optimizer_meta;                            // meta.json "optimizer"
  std::vector<std::string> optimizer_params;                // State::optimizer_params
  // Results of the write.
  std::thread thread;
  std::atomic<bool> done{false};
  std::string error;
  std::vector<WrittenFile> files;
  double write_ms = 0;
};

Checkpointer::Checkpointer(Options opts, std::shared_ptr<dist::Collectives> coll)
    : opts_(std::move(opts)), coll_(std::move(coll)) {
  rank_ = coll_->rank();
  world_ = coll_->size();
  if (opts_.dir.empty()) throw std::invalid_argument("Checkpointer: empty checkpoint directory");
  // mkdir -p of the root (every rank: nodes may not share a view until it exists).
  if (const std::string err = make_dirs(opts_.dir); !err.empty()) throw SaveError("checkpoint.dir: " + err);
}

Checkpointer::~Checkpointer() {
  // A pending write that was never committed: let it finish (its files stay uncommitted).
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

std::string resume_from_dir(const std::string& dir, const std::string& resume_from) {
  std::string d = resume_from;
  if (!d.empty() && std::all_of(d.begin(), d.end(), ::isdigit)) {
    if (d.size() > 18)
      throw ResumeError("checkpoint.resume_from = \"" + resume_from + "\": not a step number (too large)");
    return dir + "/step_" + std::to_string(std::stoll(d));
  }
  if (!is_directory(d) && is_directory(dir + "/" + d)) d = dir + "/" + d;
  return d;
}

std::string Checkpointer::step_dir(int64_t step) const { return opts_.dir + "/step_" + std::to_string(step); }

bool Checkpointer::write_finished() const { return !pending_ || pending_->done.load(); }

double Checkpointer::last_write_ms() const { return pending_ ? pending_->write_ms : last_write_ms_; }

void Checkpointer::write_shards(Pending& p) {
  const auto t0 = Clock::now();
  // The model shard is written on a second thread while this one writes the optimizer shard
  // and the rest: measured here, one writer leaves the disk idle while it copies and hashes.
  auto hooked = [&](const std::string& file) {
    WriteOptions o;
    if (const auto& h = opts_.hooks.before_write)
      o.before_write = [h, step = p.step, file](uint64_t offset) { return h(step, file, offset); };
    return o;
  };
  WrittenFile model_written;
  std::string model_error;
  std::thread model_writer([&] {
    try {
      const std::string file = model_file(rank_, world_);
      model_written = write_safetensors(p.dir + "/" + file, p.model_shard,
                                        {{"format", "pt"}, {"keel_step", std::to_string(p.step)}}, hooked(file));
    } catch (const std::exception& e) {
      model_error = e.what();
    }
  });
  std::vector<WrittenFile> rest;
  try {
    rest.push_back(write_safetensors(p.dir + "/" + optimizer_file(rank_, world_), p.optimizer_shard,
                                     {{"keel_step", std::to_string(p.step)}}, hooked(optimizer_file(rank_, world_))));
    if (p.has_extra)
      rest.push_back(write_safetensors(p.dir + "/" + extra_file(rank_, world_), p.extra_shard,
                                       {{"keel_step", std::to_string(p.step)}}, hooked(extra_file(rank_, world_))));
    rest.push_back(
        write_safetensors(p.dir + "/" + rank_file(rank_), p.rank_tensors, p.rank_meta, hooked(rank_file(rank_))));
    if (rank_ == 0 && !p.graph.empty()) rest.push_back(write_atomic(p.dir + "/" + kGraph, p.graph));
    if (rank_ == 0 && !p.package.empty()) {
      rest.push_back(write_atomic(p.dir + "/" + kPackage, p.package));
      rest.push_back(write_atomic(p.dir + "/" + kPackageManifest, p.package_manifest));
    }
  } catch (const std::exception& e) {
    p.error = e.what();
  }
  model_writer.join();
  if (!model_error.empty()) p.error = model_error;  // the first file's error is the one to report
  if (p.error.empty()) {
    p.files.push_back(model_written);
    p.files.insert(p.files.end(), rest.begin(), rest.end());
    try {
      fsync_dir(p.dir);
    } catch (const std::exception& e) {
      p.error = e.what();
    }
  }
  p.write_ms = ms_since(t0);
  p.done.store(true);
}

namespace {

// Step 1 of a save: the plan (which tensors, in which shard), identical on every rank by
// construction and checked across ranks with one all-gather of its fingerprint. A partitioned
// optimizer state (dist.zero >= 1) is not in it: each rank writes its own partition, which must
// hold only the state of parameters it owns. Returns each planned tensor's writing rank.
std::vector<int64_t> agree_on_plan(dist::Collectives& coll, int64_t world, int64_t rank, int64_t step,
                                   const State& state, bool partitioned) {
  std::map<std::string, int64_t> owner_of_param(state.optimizer_owners.begin(), state.optimizer_owners.end());
  if (partitioned)
    for (const auto& [name, t] : state.optimizer) {
      const auto it = owner_of_param.find(name.substr(0, name.find_last_of('.')));
      if (it == owner_of_param.end() || it->second != rank)
        throw SaveError("checkpoint step " + std::to_string(step) + ": optimizer state \"" + name +
                        "\" is not of a parameter this rank owns");
    }
  std::vector<uint64_t> sizes;
  std::string layout = "world=" + std::to_string(world) + ";zero=" + std::to_string(state.zero) + ";";
  for (const auto* list : {&state.model, &state.optimizer, &state.extra}) {
    if (partitioned && list == &state.optimizer) continue;
    for (const auto& [name, t] : *list) {
      sizes.push_back(nbytes(t));
      layout += name + ":" + c10::toString(t.scalar_type()) + ":" + std::to_string(t.numel()) + ";";
    }
  }
  for (const auto& [name, r] : state.optimizer_owners) layout += "owner:" + name + "=" + std::to_string(r) + ";";
  for (const auto& n : state.optimizer_params) layout += "param:" + n + ";";
  for (const auto& [f, kind] : state.optimizer_fields) layout += "field:" + f + "=" + kind + ";";
  std::string differ;
  if (const auto d = dist::agree(
          coll, dist::fingerprint(layout), [] { return std::string(); }, "checkpoint plan"))
    for (const int64_t r : d.differing_from(rank)) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  if (!differ.empty())
    throw SaveError("checkpoint step " + std::to_string(step) + ": rank(s) " + differ +
                    " hold a different set of "
                    "tensors (names, dtypes or sizes) than rank " +
                    std::to_string(rank) +
                    "; model and optimizer state must be replicated, or the optimizer partitioned the same way");
  return assign_shards(sizes, world);
}

// A partitioned optimizer state's index: every rank's tensor names, through one all-gather of
// their lengths and one of the names (padded to the longest). Rank 0 gets name -> file; the
// others an empty object.
nlohmann::json gather_optimizer_index(dist::Collectives& coll, int64_t world, int64_t rank, const State& state) {
  std::string mine;
  for (const auto& [name, t] : state.optimizer) mine += name + "\n";
  const auto all = dist::all_gather_strings(coll, mine, "checkpoint optimizer index");
  nlohmann::json map = nlohmann::json::object();
  for (int64_t r = 0; r < world && rank == 0; ++r) {
    for (const auto& name : split_lines(all[static_cast<size_t>(r)])) map[name] = optimizer_file(r, world);
  }
  return map;
}

// The tensor a save writes: `t` itself, or with checkpoint.async a copy into a staging buffer
// kept from one save to the next under `key` (pinned host memory for device tensors), so that
// a snapshot is a memcpy, not an allocation (fresh pages are slow to fault in). Reusing them is
// safe: a save waits for the previous write first.
torch::Tensor snapshot(std::map<std::string, torch::Tensor>& staging, bool async, const std::string& key,
                       const torch::Tensor& t) {
  torch::Tensor d = t.detach();
  if (!async) return d;
  auto it = staging.find(key);
  if (it == staging.end() || it->second.sizes() != d.sizes() || it->second.scalar_type() != d.scalar_type()) {
    auto o = torch::TensorOptions().dtype(d.scalar_type()).device(torch::kCPU).pinned_memory(d.is_cuda());
    it = staging.insert_or_assign(key, torch::empty(d.sizes(), o)).first;
  }
  it->second.copy_(d);
  return it->second;
}

}  // namespace

void Checkpointer::save(int64_t step, const State& state) {
  const auto t0 = Clock::now();
  commit();  // the previous async save, if any
  if (step == last_committed_) {
    logging::debug("checkpoint: step {} is already committed", step);
    last_blocking_ms_ = ms_since(t0);
    return;
  }
  auto p = std::make_unique<Pending>();
  p->step = step;
  p->dir = step_dir(step);
  p->shared = state.shared;

  // 1. The plan, agreed across ranks.
  const bool partitioned = !state.optimizer_owners.empty();
  const std::vector<int64_t> owner = agree_on_plan(*coll_, world_, rank_, step, state, partitioned);
  p->optimizer_meta = {{"zero", state.zero}, {"partitioned", partitioned}};
  p->optimizer_params = state.optimizer_params;
  if (!state.optimizer_fields.empty()) p->optimizer_meta["fields"] = state.optimizer_fields;
  if (partitioned) {
    nlohmann::json owners = nlohmann::json::object();
    for (const auto& [name, r] : state.optimizer_owners) owners[name] = r;
    p->optimizer_meta["owners"] = owners;
    p->optimizer_map = gather_optimizer_index(*coll_, world_, rank_, state);
  }
  // 2. This rank's share: owned replicated tensors, and its own state (copied for async).
  const auto take = [&](const std::string& key, const torch::Tensor& t) {
    return snapshot(staging_, opts_.async, key, t);
  };
  size_t i = 0;
  for (const auto& [name, t] : state.model) {
    p->model_names.push_back(name);
    p->model_owner.push_back(owner[i]);
    p->model_bytes += nbytes(t);
    if (owner[i++] == rank_) p->model_shard.emplace_back(name, take("m:" + name, t));
  }
  for (const auto& [name, t] : state.optimizer) {
    if (partitioned) {
      p->optimizer_shard.emplace_back(name, take("o:" + name, t));
      continue;
    }
    p->optimizer_map[name] = optimizer_file(owner[i], world_);
    if (owner[i++] == rank_) p->optimizer_shard.emplace_back(name, take("o:" + name, t));
  }
  for (const auto& [name, t] : state.extra)
    if (owner[i++] == rank_) p->extra_shard.emplace_back(name, take("e:" + name, t));
  p->has_extra = !state.extra.empty();
  const std::string prefix = "rank." + std::to_string(rank_) + ".";
  for (const auto& [name, t] : state.rank_tensors) p->rank_tensors.emplace_back(prefix + name, take("r:" + name, t));
  p->rank_meta[kRankStateKey] = state.rank_state.dump();
  p->rank_meta["keel_step"] = std::to_string(step);
  if (rank_ == 0) {
    p->graph = state.graph;
    p->package = state.package;
    p->package_manifest = state.package_manifest;
  }

  // 3. The write: on this thread, or on the writer thread with checkpoint.async.
  try {
    if (const std::string err = make_dirs(p->dir); !err.empty()) throw SaveError(err);
  } catch (const std::exception& e) {
    p->error = e.what();
    p->done.store(true);
  }
  pending_step_ = step;
  Pending* raw = p.get();
  pending_ = std::move(p);
  if (!raw->done.load()) {
    if (opts_.async)
      raw->thread = std::thread([this, raw] { write_shards(*raw); });
    else
      write_shards(*raw);
  }
  last_blocking_ms_ = ms_since(t0);
  if (!opts_.async) {
    commit();
    last_blocking_ms_ = ms_since(t0);
  }
}

void Checkpointer::commit() {
  if (!pending_) return;
  std::unique_ptr<Pending> p = std::move(pending_);
  pending_step_ = -1;
  if (p->thread.joinable()) p->thread.join();
  last_write_ms_ = p->write_ms;

  // 3a. Every rank's result.
  nlohmann::json mine = {{"ok", p->error.empty()}, {"error", p->error}, {"files", nlohmann::json::array()}};
  for (const auto& f : p->files) mine["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  const auto all = dist::all_gather_strings(*coll_, mine.dump(), "checkpoint commit");
  std::vector<nlohmann::json> results;
  std::string failures;
  for (int64_t r = 0; r < world_; ++r) {
    results.push_back(nlohmann::json::parse(all[static_cast<size_t>(r)]));
    if (!results.back()["ok"].get<bool>())
      failures += "\n  rank " + std::to_string(r) + ": " + results.back()["error"].get<std::string>();
  }
  const std::string previous = last_committed_ >= 0 ? "step " + std::to_string(last_committed_) : "none";
  if (!failures.empty())
    throw SaveError("checkpoint step " + std::to_string(p->step) +
                    " was not saved (nothing committed; the previous "
                    "checkpoint, " +
                    previous + ", is intact):" + failures);

  // 3b. Rank 0 writes the index and the commit marker; every rank learns the outcome.
  std::string error;
  if (rank_ == 0) {
    try {
      nlohmann::json files = nlohmann::json::object();
      for (int64_t r = 0; r < world_; ++r)
        for (const auto& f : results[r]["files"])
          files[f["name"].get<std::string>()] = {{"bytes", f["bytes"]}, {"sha256", f["sha256"]}, {"rank", r}};
      nlohmann::json index = {{"metadata", {{"total_size", p->model_bytes}}}, {"weight_map", nlohmann::json::object()}};
      for (size_t k = 0; k < p->model_names.size(); ++k)
        index["weight_map"][p->model_names[k]] = model_file(p->model_owner[k], world_);
      const WrittenFile idx = write_atomic(p->dir + "/" + kIndex, index.dump(2) + "\n");
      files[idx.name] = {{"bytes", idx.bytes}, {"sha256", idx.sha256}, {"rank", 0}};
      if (p->optimizer_meta.contains("fields")) {
        // Which fields each parameter has: from the index (every rank's state names).
        nlohmann::json manifest = nlohmann::json::object();
        for (const auto& n : p->optimizer_params) manifest[n] = nlohmann::json::array();
        for (auto it = p->optimizer_map.begin(); it != p->optimizer_map.end(); ++it) {
          const std::string& n = it.key();
          const size_t dot = n.find_last_of('.');
          manifest[n.substr(0, dot)].push_back(n.substr(dot + 1));
        }
        p->optimizer_meta["state"] = manifest;
      }
      nlohmann::json opt_index = {{"metadata", {{"zero", p->optimizer_meta["zero"]}, {"world_size", world_}}},
                                  {"weight_map", p->optimizer_map}};
      const WrittenFile oidx = write_atomic(p->dir + "/" + kOptimizerIndex, opt_index.dump(2) + "\n");
      files[oidx.name] = {{"bytes", oidx.bytes}, {"sha256", oidx.sha256}, {"rank", 0}};
      nlohmann::json meta = {{"format", "keel-checkpoint"},
                             {"format_version", 1},
                             {"step", p->step},
                             {"world_size", world_},
                             {"config_sha256", opts_.config_sha256},
                             {"keel_version", KEEL_VERSION},
                             {"torch_version", TORCH_VERSION},
                             {"created_utc", utc_now()},
                             {"state", p->shared},
                             {"optimizer", p->optimizer_meta},
                             {"files", files}};
      write_atomic(p->dir + "/" + kMeta, meta.dump(2) + "\n");
      fsync_dir(p->dir);
      fsync_dir(opts_.dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (const dist::RankError e = dist::first_error(*coll_, error, "checkpoint commit outcome"))
    throw SaveError("checkpoint step " + std::to_string(p->step) + " was not committed: rank 0 could not write " +
                    "its index or meta.json: " + e.message + "; the previous checkpoint, " + previous + ", is intact");
  last_committed_ = p->step;
  uint64_t total = 0;
  size_t nfiles = 0;
  for (const auto& r : results)
    for (const auto& f : r["files"]) total += f["bytes"].get<uint64_t>(), ++nfiles;
  logging::info("checkpoint: step {} committed ({:.1f} MB in {} files; this rank wrote in {:.0f} ms) -> {}", p->step,
                total / 1e6, nfiles, p->write_ms, p->dir);
  if (rank_ == 0) cleanup(p->step);
  if (opts_.hooks.after_commit) opts_.hooks.after_commit(p->step, p->dir);
}

void Checkpointer::cleanup(int64_t keep_step) {
  std::vector<StepInfo> committed;
  for (const auto& s : list_steps(opts_.dir)) {
    if (s.committed)
      committed.push_back(s);
    else if (s.step != keep_step) {
      logging::info("checkpoint: removing uncommitted {}", s.path);
      remove_tree(s.path);
    }
  }
  // Stray files in the new step (an earlier, aborted save of the same step).
  try {
    const nlohmann::json meta = read_meta(step_dir(keep_step));
    for (const auto& n : list_dir(step_dir(keep_step)))
      if (n != kMeta && !meta["files"].contains(n)) remove_tree(step_dir(keep_step) + "/" + n);
  } catch (const std::exception&) {
  }
  const int64_t excess = static_cast<int64_t>(committed.size()) - opts_.keep;
  for (int64_t k = 0; k < excess; ++k) {
    if (committed[k].step == keep_step) continue;
    logging::debug("checkpoint: removing {} (checkpoint.keep = {})", committed[k].path, opts_.keep);
    // The marker goes first, so a half-removed step is never taken for a committed one.
    std::remove((committed[k].path + "/" + kMeta).c_str());
    remove_tree(committed[k].path);
  }
}

// ---------------------------------------------------------------------------------------------

namespace {

// meta.json records every parameter the optimizer updates and the fields of its state; the
// index must list exactly those tensors: state that went missing (a deleted partition, removed
// index entries) is named by parameter, never replaced by a fresh state. Checked on every rank
// whatever part it reads, so that every rank reaches the same verdict.
void check_optimizer_manifest(const nlohmann::json& o, const std::map<std::string, std::string>& index,
                              const std::string& dir, bool has_index) {
  const std::string where = dir + "/" + kMeta + " and " + kOptimizerIndex;
  if (!has_index) throw FormatError(dir + ": meta.json records optimizer state but lists no " + kOptimizerIndex);
  std::set<std::string> recorded;
  std::string missing, unknown;
  int64_t n_missing = 0;
  for (auto it = o["state"].begin(); it != o["state"].end(); ++it)
    for (const auto& f : it.value()) {
      const std::string name = it.key() + "." + f.get<std::string>();
      recorded.insert(name);
      if (!index.count(name) && n_missing++ < 8) missing += (missing.empty() ? "" : ", ") + name;
    }
  for (const auto& [n, f] : index)
    if (!recorded.count(n)) unknown += (unknown.empty() ? "" : ", ") + n;
  if (n_missing > 0)
    throw FormatError(where + ": the optimizer state of " + std::to_string(n_missing) + " tensor(s) is missing (" +
                      missing + (n_missing > 8 ? ", ..." : "") + "): meta.json records it, the index does not list it");
  if (!unknown.empty())
    throw FormatError(where +
                      ": the index lists optimizer state that meta.json does not record: " + unknown.substr(0, 400));
}

// Each optimizer state tensor this rank read has its field's kind: a step count is one integer
// element in [0, step]; the others have their parameter's shape and dtype.
// `o`: meta.json's "optimizer" with its record of the state's fields (steps written before it
// existed carry none: their owner checks them, trainer/optim.h OptimizerState::check).
void check_optimizer_tensors(const nlohmann::json& o, const Loaded& L, const std::string& dir,
                             const std::map<std::string, std::string>& index) {
  std::map<std::string, const torch::Tensor*> model;
  for (const auto& [n, t] : L.state.model) model[n] = &t;
  for (auto it = o["state"].begin(); it != o["state"].end(); ++it)
    if (!model.count(it.key()))
      throw FormatError(dir + "/" + kMeta + ": optimizer.state names \"" + it.key() +
                        "\", which is not a model tensor");
  for (const auto& [n, t] : L.state.optimizer) {
    const size_t dot = n.find_last_of('.');
    if (dot == std::string::npos) throw FormatError(dir + ": optimizer state \"" + n + "\" is not <parameter>.<field>");
    const std::string param = n.substr(0, dot), field = n.substr(dot + 1);
    if (!model.count(param))
      throw FormatError(dir + ": optimizer state \"" + n + "\" is of " + param + ", which is not a model tensor");
    const std::string problem =
        optimizer_tensor_problem(n, t, o["fields"].value(field, "param") == "scalar", *model.at(param), L.step);
    if (!problem.empty()) {
      const auto file = index.find(n);
      throw FormatError(dir + "/" + (file == index.end() ? std::string("?") : file->second) + ": " + problem);
    }
  }
}

// The files `names` of step `dir`, mapped and checksummed in parallel (SHA-256 runs at ~1.6 GB/s
// on one core); the first failure, if any, as FormatError.
std::vector<SafetensorsFile> read_shards(const nlohmann::json& meta, const std::string& dir,
                                         const std::vector<std::string>& names) {
  std::vector<SafetensorsFile> files(names.size());
  std::vector<std::string> errors(names.size());
  const size_t workers = std::max<size_t>(1, std::min<size_t>(names.size(), std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (size_t w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (size_t k; (k = next.fetch_add(1)) < names.size();) {
        try {
          files[k] = read_safetensors(dir + "/" + names[k], expected_sha(meta, dir, names[k]));
        } catch (const std::exception& e) {
          errors[k] = e.what();
        }
      }
    });
  for (auto& t : pool) t.join();
  for (const auto& e : errors)
    if (!e.empty()) throw FormatError(e);
  return files;
}

// Rank `rank`'s own file of the step: its tensors (the "rank.<r>." prefix taken off) and state.
void read_rank_file(Loaded& L, const std::string& dir, int64_t rank) {
  const std::string name = rank_file(rank);
  auto f = read_safetensors(dir + "/" + name, expected_sha(L.meta, dir, name));
  const std::string prefix = "rank." + std::to_string(rank) + ".";
  for (auto& [n, t] : f.tensors) {
    if (n.rfind(prefix, 0) != 0)
      throw FormatError(dir + "/" + name + ": tensor \"" + n + "\" does not belong to rank " + std::to_string(rank));
    L.state.rank_tensors.emplace_back(n.substr(prefix.size()), std::move(t));
  }
  auto it = f.header.metadata.find(kRankStateKey);
  if (it != f.header.metadata.end()) {
    try {
      L.state.rank_state = nlohmann::json::parse(it->second);
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(dir + "/" + name + ": rank state is not valid JSON: " + e.what());
    }
  }
  L.has_rank_state = true;
}

Loaded read_step(const std::string& dir, int64_t rank, const Wants& wants) {
  Loaded L;
  L.path = dir;
  L.meta = read_meta(dir);
  L.step = L.meta["step"].get<int64_t>();
  L.saved_world_size = L.meta["world_size"].get<int64_t>();
  const int64_t W = L.saved_world_size;
  if (L.meta.contains("state") && L.meta["state"].is_object()) L.state.shared = L.meta["state"];
  std::set<std::string> seen;
  // The optimizer index says which file holds each optimizer state tensor: only the files with
  // a wanted one are read (a step written before the index existed: all of them).
  std::map<std::string, std::string> optimizer_map;
  const bool has_optimizer_index = L.meta["files"].contains(kOptimizerIndex);
  std::set<std::string> optimizer_files;
  for (int64_t r = 0; r < W; ++r) {
    optimizer_files.insert(optimizer_file(r, W));
    expected_sha(L.meta, dir, model_file(r, W));  // the saved world's shards are listed and present
  }
  for (int64_t r = 0; r < W && has_optimizer_index; ++r)
    expected_sha(L.meta, dir, optimizer_file(r, W));  // every rank of the saved job wrote one, maybe empty
  if (has_optimizer_index)
    optimizer_map = parse_optimizer_index(read_verified(L.meta, dir, kOptimizerIndex), dir + "/" + kOptimizerIndex,
                                          optimizer_files);
  const nlohmann::json* manifest = nullptr;  // meta.json optimizer.fields / .state (parse_meta checked their form)
  if (L.meta.contains("optimizer") && L.meta["optimizer"].contains("state")) {
    manifest = &L.meta["optimizer"];
    check_optimizer_manifest(*manifest, optimizer_map, dir, has_optimizer_index);
  }
  // The shards: the model's, the optimizer's that hold a wanted tensor, the extra state's.
  const bool has_extra = L.meta["files"].contains(extra_file(0, W));
  std::set<std::string> needed_optimizer;
  for (const auto& [n, f] : optimizer_map)
    if (!wants || wants(n)) needed_optimizer.insert(f);
  std::vector<std::string> names;
  for (int64_t r = 0; r < W; ++r) {
    names.push_back(model_file(r, W));
    if (!has_optimizer_index || !wants || needed_optimizer.count(optimizer_file(r, W)))
      names.push_back(optimizer_file(r, W));
    if (has_extra) names.push_back(extra_file(r, W));
  }
  for (const auto& n : names) L.optimizer_files_read += n[0] == 'o';
  if (L.meta.contains("optimizer")) L.saved_zero = L.meta["optimizer"]["zero"].get<int64_t>();
  std::vector<SafetensorsFile> files = read_shards(L.meta, dir, names);
  for (size_t k = 0; k < names.size(); ++k) {
    const char kind = names[k][0];  // m(odel), o(ptimizer), e(xtra)
    NamedTensors& into = kind == 'm' ? L.state.model : kind == 'o' ? L.state.optimizer : L.state.extra;
    for (auto& [n, t] : files[k].tensors) {
      if (!seen.insert(std::string(1, kind) + ":" + n).second)
        throw FormatError(dir + "/" + names[k] + ": tensor \"" + n + "\" is also stored in another shard");
      if (kind == 'o' && has_optimizer_index) {
        const auto it = optimizer_map.find(n);
        if (it == optimizer_map.end() || it->second != names[k])
          throw FormatError(dir + "/" + names[k] + ": holds \"" + n + "\", which " + kOptimizerIndex + " places " +
                            (it == optimizer_map.end() ? std::string("nowhere") : "in " + it->second));
      }
      if (kind == 'o' && wants && !wants(n)) continue;
      into.emplace_back(n, std::move(t));
    }
  }
  if (manifest) check_optimizer_tensors(*manifest, L, dir, optimizer_map);
  // Every wanted optimizer tensor the index lists was found where it says.
  for (const auto& [n, f] : optimizer_map)
    if ((!wants || wants(n)) && !seen.count("o:" + n))
      throw FormatError(dir + "/" + kOptimizerIndex + ": lists \"" + n + "\" in " + f + ", which does not hold it");
  // The Hugging Face index must agree with the shards.
  {
    const std::string path = dir + "/" + kIndex;
    const std::string text = read_verified(L.meta, dir, kIndex);
    std::set<std::string> shard_names, model_tensors;
    for (int64_t r = 0; r < W; ++r) shard_names.insert(model_file(r, W));
    for (const auto& [n, t] : L.state.model) model_tensors.insert(n);
    check_index(text, path, shard_names, model_tensors);
  }
  if (rank < W) read_rank_file(L, dir, rank);
  if (L.meta["files"].contains(kGraph)) {
    const std::string path = dir + "/" + kGraph;
    if (sha256_file(path) != expected_sha(L.meta, dir, kGraph)) throw FormatError(path + ": checksum mismatch");
    L.state.graph = path;  // the path; callers load it with torch::jit::load
  }
  // The inductor package is not training state: a damaged one is reported and left out (the
  // compile cache then packages the step anew), never a reason to give up the step. Checked
  // where it is used (trainer/compile/inductor.cpp), so not hashed here on every rank.
  for (const auto& [name, field] :
       {std::pair{kPackage, &L.state.package}, std::pair{kPackageManifest, &L.state.package_manifest}})
    if (L.meta["files"].contains(name)) *field = dir + "/" + name;
  return L;
}

}  // namespace

std::optional<Loaded> Checkpointer::load(const std::string& resume_from,
                                         const std::function<std::string(const Loaded&)>& validate) {
  std::vector<std::string> candidates;
  if (!resume_from.empty()) {
    const std::string d = resume_from_dir(opts_.dir, resume_from);
    if (!path_exists(d + "/" + kMeta))
      throw ResumeError("checkpoint.resume_from = \"" + resume_from + "\": " + d +
                        " is not a committed checkpoint step (no meta.json)");
    candidates.push_back(d);
  } else {
    if (rank_ == 0)
      for (const auto& n : list_dir(opts_.dir))
        if (n.rfind("step_", 0) == 0 && is_symlink(opts_.dir + "/" + n))
          logging::warn("checkpoint: ignoring {}/{}: a symbolic link (steps must be directories of checkpoint.dir)",
                        opts_.dir, n);
    const auto steps = list_steps(opts_.dir);
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      if (it->committed)
        candidates.push_back(it->path);
      else if (rank_ == 0)
        logging::info("checkpoint: ignoring {} (never committed)", it->path);
    }
  }
  for (const auto& dir : candidates) {
    std::string problem;
    Loaded L;
    try {
      L = read_step(dir, rank_, opts_.wants_optimizer_tensor);
      if (validate) problem = validate(L);
      if (!problem.empty()) problem = dir + "/" + kMeta + ": " + problem;
    } catch (const std::exception& e) {
      problem = e.what();
    }
    // Every rank the same verdict, naming the first rank's problem (a rank reads only its own
    // part of a partitioned optimizer state).
    const dist::RankError failed = dist::first_error(*coll_, problem, "checkpoint load verdict");
    if (!failed) {
      last_committed_ = L.step;
      logging::info(
          "checkpoint: {} (saved by {} rank(s), dist.zero = {}): this rank read and verified {} of the step's {} "
          "optimizer file(s)",
          dir, L.saved_world_size, L.saved_zero, L.optimizer_files_read, L.saved_world_size);
      return L;
    }
    const std::string why =
        failed.rank == rank_ ? problem : "on rank " + std::to_string(failed.rank) + ": " + failed.message;
    if (!resume_from.empty())
      throw ResumeError("checkpoint.resume_from = \"" + resume_from + "\" cannot be loaded: " + why);
    logging::warn("checkpoint: {} cannot be used: {}; falling back to the previous committed step", dir, why);
  }
  if (!candidates.empty()) set_aside(candidates);
  return std::nullopt;
}

// Every committed step failed to load: they are moved, not overwritten, to <dir>/corrupt/ (kept
// for `keel inspect` and for a person to look at), and the run starts fresh. Refusing to start
// would only spend a launcher's restarts on the same failure. After the load's last collective,
// so no rank still reads them; rank 0 moves (as it alone rotates).
void Checkpointer::set_aside(const std::vector<std::string>& steps) {
  if (rank_ != 0) return;
  const std::string aside = opts_.dir + "/corrupt";
  if (const std::string err = make_dirs(aside); !err.empty()) {
    logging::warn("checkpoint: cannot set the unusable steps aside ({}); they will be overwritten", err);
    return;
  }
  for (const auto& from : steps) {
    std::string to = aside + "/" + from.substr(from.find_last_of('/') + 1);
    for (int k = 1; path_exists(to); ++k)
      to = aside + "/" + from.substr(from.find_last_of('/') + 1) + "." + std::to_string(k);
    if (::rename(from.c_str(), to.c_str()) != 0)
      logging::warn("checkpoint: cannot move {} to {}: {}", from, to, std::strerror(errno));
  }
  logging::warn(
      "checkpoint: none of the {} committed step(s) under {} can be used; moved to {} (kept, see the "
      "warnings above and `keel inspect {}`); starting fresh",
      steps.size(), opts_.dir, aside, aside);
}

}  // namespace keel::checkpoint

namespace keel::checkpoint {

void copy_into(const NamedTensors& targets, const NamedTensors& source, const std::string& what) {
  std::map<std::string, const torch::Tensor*> src;
  for (const auto& [n, t] : source) src[n] = &t;
  std::string missing, mismatched, unexpected;
  std::set<std::string> target_names;
  for (const auto& [n, t] : targets) {
    target_names.insert(n);
    auto it = src.find(n);
    if (it == src.end()) {
      missing += "\n    " + n + " " + c10::toString(t.scalar_type()) + c10::str(t.sizes());
      continue;
    }
    const torch::Tensor& s = *it->second;
    if (s.sizes() != t.sizes() || s.scalar_type() != t.scalar_type())
      mismatched += "\n    " + n + ": checkpoint " + c10::toString(s.scalar_type()) + c10::str(s.sizes()) + ", model " +
                    c10::toString(t.scalar_type()) + c10::str(t.sizes());
  }
  for (const auto& [n, t] : source)
    if (!target_names.count(n)) unexpected += "\n    " + n + " " + c10::toString(t.scalar_type()) + c10::str(t.sizes());
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::string m = what + " does not fit the model:";
    if (!missing.empty()) m += "\n  missing from the checkpoint:" + missing;
    if (!unexpected.empty()) m += "\n  unexpected (not in the model):" + unexpected;
    if (!mismatched.empty()) m += "\n  mismatched dtype or shape:" + mismatched;
    throw BindError(m);
  }
  torch::NoGradGuard no_grad;
  for (const auto& [n, t] : targets) {
    torch::Tensor dst = t;
    dst.copy_(*src[n]);
  }
}

}  // namespace keel::checkpoint
