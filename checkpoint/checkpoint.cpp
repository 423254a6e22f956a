#include "checkpoint/checkpointer.h"

#include "checkpoint/meta.h"
#include "dist/phase.h"

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
const char* kRankStateKey = "keel.rank_state";
constexpr int64_t kFormatVersion = 2;

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

std::string component_file(const std::string& component, int64_t rank, int64_t world) {
  return component + numbered("-%05ld-of-%05ld.safetensors", rank + 1, world);
}
std::string index_file(const std::string& component) { return component + ".safetensors.index.json"; }
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
using Wants = std::function<bool(const std::string&, const std::string&)>;
Loaded read_step(const std::string& dir, int64_t rank, const Wants& wants);
}  // namespace

// Every file's checksum (each problem listed), then the loader's own checks (read_step: the
// shard set of the saved world, each index against meta.json and the shards, each tensor's
// recorded dtype and shape, each rank's file). What each component makes of its values (a
// step count in range, the loss scale) is the component's check at load, not this one's.
std::vector<std::string> verify_step(const std::string& step_dir) {
  nlohmann::json meta;
  try {
    meta = read_meta(step_dir);
  } catch (const std::exception& e) {
    return {e.what()};
  }
  // The loader's own checks first: they checksum every file they read (the components' files
  // and indexes, rank 0's file), so those are not hashed twice.
  std::string load_error;
  std::set<std::string> hashed;
  try {
    const Loaded L = read_step(step_dir, 0, {});
    hashed.insert(rank_file(0));
    for (const auto& [c, lc] : L.components) {
      if (!meta["files"].contains(component_file(c, 0, L.saved_world_size))) continue;
      for (int64_t r = 0; r < L.saved_world_size; ++r) hashed.insert(component_file(c, r, L.saved_world_size));
      hashed.insert(index_file(c));
    }
  } catch (const std::exception& e) {
    load_error = e.what();
  }
  // Then each listed file the loader did not check, or, when it failed, every listed file, so
  // that every damaged file is named and not only the first.
  std::vector<std::string> problems;
  for (auto it = meta["files"].begin(); it != meta["files"].end(); ++it) {
    if (load_error.empty() && hashed.count(it.key())) continue;
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
  struct File {
    std::string name;
    NamedTensors tensors;  // a safetensors file with its metadata, or
    std::map<std::string, std::string> metadata;
    bool whole = false;  // a whole file (rank 0's), these bytes
    std::string bytes;
  };
  std::vector<File> files;  // this rank's
  // Rank 0's record of the step: meta.json "components", and each component's index.
  nlohmann::json components = nlohmann::json::object();
  std::map<std::string, nlohmann::json> indexes;
  // Results of the write.
  std::thread thread;
  std::atomic<bool> done{false};
  std::string error;
  std::vector<WrittenFile> written;
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
  // Two writers, largest file first: measured here, one writer leaves the disk idle while it
  // copies and hashes.
  std::vector<WrittenFile> written(p.files.size());
  std::vector<std::string> errors(p.files.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1)) < p.files.size();) {
      const auto& f = p.files[k];
      try {
        if (f.whole) {
          written[k] = write_atomic(p.dir + "/" + f.name, f.bytes);
          continue;
        }
        WriteOptions o;
        if (const auto& h = opts_.hooks.before_write)
          o.before_write = [h, step = p.step, file = f.name](uint64_t offset) { return h(step, file, offset); };
        written[k] = write_safetensors(p.dir + "/" + f.name, f.tensors, f.metadata, o);
      } catch (const std::exception& e) {
        errors[k] = e.what();
      }
    }
  };
  std::thread second(work);
  work();
  second.join();
  for (const auto& e : errors)
    if (!e.empty() && p.error.empty()) p.error = e;  // the first file's error is the one to report
  if (p.error.empty()) {
    p.written = written;
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

nlohmann::json shape_record(const torch::Tensor& t) {
  return {{"dtype", safetensors_dtype(t.scalar_type())}, {"shape", t.sizes().vec()}};
}

// One component's part of a step, as every rank plans it.
struct ComponentPlan {
  std::map<std::string, std::string> index;           // each replicated and owned tensor -> its file
  nlohmann::json tensors = nlohmann::json::object();  // name -> {"dtype", "shape"}
  nlohmann::json owned = nlohmann::json::array();
  uint64_t bytes = 0;
  NamedTensors mine;  // this rank's file: its share of the replicated tensors, then its own
};

// What is wrong with this rank's `state` on its own (names, tensors, whole files), or "". Run
// through one collective before any other, so that a problem on one rank (an owned tensor
// only it holds) throws on every rank instead of leaving the others in the next collective.
std::string local_problem(const State& state) {
  std::set<std::string> whole_files;
  for (const auto& [c, comp] : state.components) {
    if (const std::string p = component_name_problem(c); !p.empty()) return "component name \"" + c + "\" " + p;
    std::set<std::string> names;
    for (const auto& e : comp.tensors) {
      if (e.name.empty() || e.name.find_first_of("\t\n") != std::string::npos)
        return "component " + c + ": a tensor name is empty or holds a tab or newline";
      if (!names.insert(e.name).second) return "component " + c + " has two tensors named \"" + e.name + "\"";
      if (!e.tensor.defined()) return "component " + c + ": tensor \"" + e.name + "\" is undefined";
      try {
        safetensors_dtype(e.tensor.scalar_type());
      } catch (const std::exception& x) {
        return "component " + c + ": tensor \"" + e.name + "\": " + x.what();
      }
    }
    for (const auto& [f, bytes] : comp.files) {
      if (!plain_name(f) || f == kMeta || f.starts_with("rank-") || f.ends_with(".safetensors") ||
          f.ends_with(".safetensors.index.json"))
        return "component " + c + ": \"" + f +
               "\" cannot name a whole file of a step (a plain name that is not "
               "meta.json, rank-*, *.safetensors or *.safetensors.index.json)";
      if (!whole_files.insert(f).second) return "component " + c + ": another component also writes \"" + f + "\"";
    }
  }
  return "";
}

// Step 1 of a save: the plan, identical on every rank by construction and checked across ranks
// with one all-gather of its fingerprint (the replicated tensors), then one all-gather of every
// rank's owned tensors (their names, dtypes and shapes) for the indexes. Every rank throws alike.
std::map<std::string, ComponentPlan> plan_save(dist::Collectives& coll, int64_t world, int64_t rank, int64_t step,
                                               const State& state) {
  const std::string at = "checkpoint step " + std::to_string(step) + ": ";
  if (const dist::RankError e = dist::first_error(coll, local_problem(state), "checkpoint plan check"))
    throw SaveError(at + "rank " + std::to_string(e.rank) + ": " + e.message);
  std::vector<uint64_t> sizes;
  std::vector<std::pair<std::string, const Component::Entry*>> replicated;
  std::string layout = "world=" + std::to_string(world) + ";", owned;
  for (const auto& [c, comp] : state.components) {
    layout += "component=" + c + ";";
    for (const auto& e : comp.tensors) {
      if (e.placement == Placement::Replicated) {
        sizes.push_back(nbytes(e.tensor));
        replicated.emplace_back(c, &e);
        layout += e.name + ":" + c10::toString(e.tensor.scalar_type()) + c10::str(e.tensor.sizes()) + ";";
      } else if (e.placement == Placement::Owned) {
        owned +=
            c + "\t" + e.name + "\t" + shape_record(e.tensor).dump() + "\t" + std::to_string(nbytes(e.tensor)) + "\n";
      }
    }
  }
  std::string differ;
  if (const auto d = dist::agree(
          coll, dist::fingerprint(layout), [] { return std::string(); }, "checkpoint plan"))
    for (const int64_t r : d.differing_from(rank)) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  if (!differ.empty())
    throw SaveError(at + "rank(s) " + differ +
                    " hold other components or replicated tensors (names, dtypes or sizes) " + "than rank " +
                    std::to_string(rank) + "; replicated tensors must be the same on every rank");
  std::map<std::string, ComponentPlan> plans;
  for (const auto& [c, comp] : state.components) plans[c];
  const std::vector<int64_t> owner = assign_shards(sizes, world);
  for (size_t i = 0; i < replicated.size(); ++i) {
    auto& p = plans[replicated[i].first];
    const auto& e = *replicated[i].second;
    p.index[e.name] = component_file(replicated[i].first, owner[i], world);
    p.tensors[e.name] = shape_record(e.tensor);
    p.bytes += nbytes(e.tensor);
    if (owner[i] == rank) p.mine.emplace_back(e.name, e.tensor);
  }
  const auto all = dist::all_gather_strings(coll, owned, "checkpoint owned tensors");
  std::string clash;
  for (int64_t r = 0; r < world; ++r)
    for (const auto& line : split_lines(all[static_cast<size_t>(r)])) {
      const size_t a = line.find('\t'), b = line.find('\t', a + 1), d = line.find('\t', b + 1);
      const std::string c = line.substr(0, a), name = line.substr(a + 1, b - a - 1);
      auto& p = plans[c];
      const auto [it, fresh] = p.index.emplace(name, component_file(c, r, world));
      if (!fresh && clash.empty())
        clash = "component " + c + "'s tensor \"" + name + "\" is owned by rank " + std::to_string(r) +
                " and also placed in " + it->second + " (owned names must be unique across ranks)";
      p.tensors[name] = nlohmann::json::parse(line.substr(b + 1, d - b - 1));
      p.owned.push_back(name);
      p.bytes += std::stoull(line.substr(d + 1));
    }
  if (!clash.empty()) throw SaveError(at + clash);  // every rank gathered the same lines
  for (const auto& [c, comp] : state.components)
    for (const auto& e : comp.tensors)
      if (e.placement == Placement::Owned) plans[c].mine.emplace_back(e.name, e.tensor);
  return plans;
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
  dist::PhaseScope phase(dist::Phase::CheckpointSave);
  if (step == last_committed_) {
    logging::debug("checkpoint: step {} is already committed", step);
    last_blocking_ms_ = ms_since(t0);
    return;
  }
  auto p = std::make_unique<Pending>();
  p->step = step;
  p->dir = step_dir(step);

  // 1. The plan, agreed across ranks.
  const auto plans = plan_save(*coll_, world_, rank_, step, state);
  // 2. This rank's files (copied for async), and rank 0's record of the step.
  const auto take = [&](const std::string& key, const torch::Tensor& t) {
    return snapshot(staging_, opts_.async, key, t);
  };
  const std::map<std::string, std::string> stamp = {{"format", "pt"}, {"keel_step", std::to_string(step)}};
  Pending::File own{rank_file(rank_), {}, stamp};
  nlohmann::json rank_values = nlohmann::json::object();
  for (const auto& [c, comp] : state.components) {
    const ComponentPlan& plan = plans.at(c);
    if (!plan.index.empty()) {
      Pending::File f{component_file(c, rank_, world_), {}, stamp};
      for (const auto& [n, t] : plan.mine) f.tensors.emplace_back(n, take(c + "\t" + n, t));
      p->files.push_back(std::move(f));
    }
    for (const auto& e : comp.tensors)
      if (e.placement == Placement::PerRank)
        own.tensors.emplace_back("rank." + std::to_string(rank_) + "." + c + "." + e.name,
                                 take("\t" + c + "\t" + e.name, e.tensor));  // tabs: no name has one
    if (!comp.rank_values.empty()) rank_values[c] = comp.rank_values;
    if (rank_ != 0) continue;
    nlohmann::json record = {{"values", comp.values}};
    if (!plan.index.empty()) {
      record["tensors"] = plan.tensors;
      if (!plan.owned.empty()) record["owned"] = plan.owned;
      p->indexes[c] = {{"metadata", {{"total_size", plan.bytes}}}, {"weight_map", plan.index}};
    }
    for (const auto& [name, bytes] : comp.files) {
      record["files"].push_back(name);
      Pending::File f{name};
      f.whole = true;
      f.bytes = bytes;  // a copy, as the tensors' snapshot: an async write outlives `state`
      p->files.push_back(std::move(f));
    }
    p->components[c] = record;
  }
  own.metadata[kRankStateKey] = rank_values.dump();
  p->files.push_back(std::move(own));
  std::stable_sort(p->files.begin(), p->files.end(), [](const Pending::File& a, const Pending::File& b) {
    const auto size = [](const Pending::File& f) {
      uint64_t n = f.bytes.size();
      for (const auto& [name, t] : f.tensors) n += nbytes(t);
      return n;
    };
    return size(a) > size(b);
  });

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
  dist::PhaseScope phase(dist::Phase::CheckpointCommit);
  std::unique_ptr<Pending> p = std::move(pending_);
  pending_step_ = -1;
  if (p->thread.joinable()) p->thread.join();
  last_write_ms_ = p->write_ms;

  // 3a. Every rank's result.
  nlohmann::json mine = {{"ok", p->error.empty()}, {"error", p->error}, {"files", nlohmann::json::array()}};
  for (const auto& f : p->written)
    mine["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
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
      for (const auto& [c, index] : p->indexes) {
        const WrittenFile idx = write_atomic(p->dir + "/" + index_file(c), index.dump(2) + "\n");
        files[idx.name] = {{"bytes", idx.bytes}, {"sha256", idx.sha256}, {"rank", 0}};
      }
      nlohmann::json meta = {{"format", "keel-checkpoint"},
                             {"format_version", kFormatVersion},
                             {"step", p->step},
                             {"world_size", world_},
                             {"config_sha256", opts_.config_sha256},
                             {"keel_version", KEEL_VERSION},
                             {"torch_version", TORCH_VERSION},
                             {"created_utc", utc_now()},
                             {"components", p->components},
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

// Rank `rank`'s own file of the step: its tensors (the "rank.<r>." prefix taken off; format 2:
// "<component>." after it) and each component's values.
void read_rank_file(Loaded& L, const std::string& dir, int64_t rank) {
  const std::string name = rank_file(rank);
  auto f = read_safetensors(dir + "/" + name, expected_sha(L.meta, dir, name));
  const std::string prefix = "rank." + std::to_string(rank) + ".", where = dir + "/" + name;
  nlohmann::json values = nlohmann::json::object();
  if (auto it = f.header.metadata.find(kRankStateKey); it != f.header.metadata.end()) {
    try {
      values = nlohmann::json::parse(it->second);
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(where + ": rank state is not valid JSON: " + e.what());
    }
    if (!values.is_object()) throw FormatError(where + ": rank state is not a JSON object");
  }
  if (L.format_version < 2) L.legacy_rank_values = values;
  for (auto it = values.begin(); it != values.end() && L.format_version >= 2; ++it) {
    if (!L.components.count(it.key()) || !it.value().is_object())
      throw FormatError(where + ": rank state \"" + it.key().substr(0, 100) +
                        "\" is not an object of a component of the step");
    L.components[it.key()].rank_values = it.value();
  }
  for (auto& [n, t] : f.tensors) {
    if (n.rfind(prefix, 0) != 0)
      throw FormatError(where + ": tensor \"" + n + "\" does not belong to rank " + std::to_string(rank));
    const std::string rest = n.substr(prefix.size());
    if (L.format_version < 2) {
      L.legacy_rank_tensors.emplace_back(rest, std::move(t));
      continue;
    }
    const size_t dot = rest.find('.');
    const auto c = dot == std::string::npos ? L.components.end() : L.components.find(rest.substr(0, dot));
    if (c == L.components.end())
      throw FormatError(where + ": tensor \"" + n + "\" is not rank." + std::to_string(rank) +
                        ".<component>.<name> of a component of the step");
    c->second.rank_tensors.emplace_back(rest.substr(dot + 1), std::move(t));
  }
  L.has_rank_state = true;
}

// Where a step keeps one component's tensors.
struct ComponentLayout {
  std::vector<std::string> shards;           // its files, in rank order
  bool has_index = false;                    // false: format 1's extra files (every file is read)
  std::map<std::string, std::string> index;  // tensor -> file
  const nlohmann::json* record = nullptr;    // format 2: meta.json components.<name>
};

// Format 2: the components meta.json records. Format 1: the stems of its tensor files (model,
// optimizer, extra), each with the index of its name where the step has one.
std::map<std::string, ComponentLayout> layout_of(const nlohmann::json& meta, const std::string& dir, int64_t W,
                                                 int64_t version) {
  std::map<std::string, ComponentLayout> out;
  const auto shards = [&](ComponentLayout& l, const std::string& c) {
    for (int64_t r = 0; r < W; ++r) l.shards.push_back(component_file(c, r, W));
  };
  if (version >= 2) {
    for (auto it = meta["components"].begin(); it != meta["components"].end(); ++it) {
      auto& l = out[it.key()];
      l.record = &it.value();
      if (it.value().contains("tensors")) shards(l, it.key()), l.has_index = true;
    }
  } else {
    const std::string tail = numbered("-%05ld-of-%05ld.safetensors", 1, W);
    for (auto it = meta["files"].begin(); it != meta["files"].end(); ++it) {
      const std::string& n = it.key();
      if (n.size() <= tail.size() || !n.ends_with(tail)) continue;
      const std::string c = n.substr(0, n.size() - tail.size());
      if (!component_name_problem(c).empty()) continue;
      shards(out[c], c);
      out[c].has_index = meta["files"].contains(index_file(c));
    }
  }
  for (auto& [c, l] : out) {
    for (const auto& f : l.shards) expected_sha(meta, dir, f);  // every rank of the saved job wrote one, maybe empty
    if (l.has_index)
      l.index = parse_index(read_verified(meta, dir, index_file(c)), dir + "/" + index_file(c),
                            std::set<std::string>(l.shards.begin(), l.shards.end()));
  }
  return out;
}

// The index lists exactly the tensors meta.json records: a tensor that went missing (a file
// deleted, index entries removed) is named, never silently absent. Checked on every rank
// whatever part it reads, so that every rank reaches the same verdict.
void check_index_against_record(const std::string& c, const ComponentLayout& l, const std::string& dir) {
  const nlohmann::json& recorded = (*l.record)["tensors"];
  std::string missing;
  int64_t n_missing = 0;
  for (auto it = recorded.begin(); it != recorded.end(); ++it)
    if (!l.index.count(it.key()) && n_missing++ < 8) missing += (missing.empty() ? "" : ", ") + it.key();
  if (n_missing > 0)
    throw FormatError(dir + "/" + index_file(c) + ": " + std::to_string(n_missing) + " tensor(s) of component " + c +
                      " that meta.json records are missing from the index (" + missing +
                      (n_missing > 8 ? ", ..." : "") + ")");
  for (const auto& [n, f] : l.index)
    if (!recorded.contains(n))
      throw FormatError(dir + "/" + index_file(c) + ": lists \"" + n.substr(0, 200) +
                        "\", which meta.json does not record");
}

// A tensor read from `file` against what meta.json records of it.
void check_tensor(const nlohmann::json& record, const std::string& name, const torch::Tensor& t,
                  const std::string& where) {
  const nlohmann::json& r = record["tensors"][name];
  const std::string dtype = safetensors_dtype(t.scalar_type());
  if (r["dtype"] != dtype || r["shape"] != nlohmann::json(t.sizes().vec()))
    throw FormatError(where + ": tensor \"" + name + "\" is " + dtype + nlohmann::json(t.sizes().vec()).dump() +
                      ", meta.json records " + r["dtype"].get<std::string>() + r["shape"].dump());
}

// Reads the files of each component that hold a tensor `wants` (all, without it): each tensor
// where its index places it, with the dtype and shape meta.json records.
void read_tensors(Loaded& L, const std::string& dir, std::map<std::string, ComponentLayout>& layouts,
                  const Wants& wants) {
  std::vector<std::string> names, of;
  for (auto& [c, l] : layouts) {
    std::set<std::string> needed;
    for (const auto& [n, f] : l.index)
      if (!wants || wants(c, n)) needed.insert(f);
    for (const auto& f : l.shards)
      if (!wants || !l.has_index || needed.count(f)) names.push_back(f), of.push_back(c), ++L.files_read[c];
    if (!L.files_read.count(c) && !l.shards.empty()) L.files_read[c] = 0;
  }
  std::vector<SafetensorsFile> files = read_shards(L.meta, dir, names);
  std::set<std::string> seen;
  for (size_t k = 0; k < names.size(); ++k) {
    const std::string& c = of[k];
    const ComponentLayout& l = layouts.at(c);
    LoadedComponent& into = L.components[c];
    const std::string where = dir + "/" + names[k];
    for (auto& [n, t] : files[k].tensors) {
      if (!seen.insert(c + "/" + n).second)
        throw FormatError(where + ": tensor \"" + n + "\" is also stored in another file of component " + c);
      if (l.has_index) {
        const auto it = l.index.find(n);
        if (it == l.index.end() || it->second != names[k])
          throw FormatError(where + ": holds \"" + n + "\", which " + index_file(c) + " places " +
                            (it == l.index.end() ? std::string("nowhere") : "in " + it->second));
      } else {
        into.index[n] = names[k];
      }
      if (l.record) check_tensor(*l.record, n, t, where);
      if (wants && !wants(c, n)) continue;
      into.tensors.emplace_back(n, std::move(t));
    }
  }
  // Every wanted tensor the index lists was found where it says.
  for (const auto& [c, l] : layouts)
    for (const auto& [n, f] : l.index)
      if ((!wants || wants(c, n)) && !seen.count(c + "/" + n))
        throw FormatError(dir + "/" + index_file(c) + ": lists \"" + n + "\" in " + f + ", which does not hold it");
}

Loaded read_step(const std::string& dir, int64_t rank, const Wants& wants) {
  Loaded L;
  L.path = dir;
  L.meta = read_meta(dir);
  L.step = L.meta["step"].get<int64_t>();
  L.saved_world_size = L.meta["world_size"].get<int64_t>();
  L.format_version = L.meta["format_version"].get<int64_t>();
  const int64_t W = L.saved_world_size;
  auto layouts = layout_of(L.meta, dir, W, L.format_version);
  std::set<std::string> tensor_files;
  for (auto& [c, l] : layouts) {
    LoadedComponent& lc = L.components[c];
    lc.present = true;
    lc.index = l.index;
    tensor_files.insert(l.shards.begin(), l.shards.end());
    if (l.has_index) tensor_files.insert(index_file(c));
    if (!l.record) continue;
    if (l.has_index) check_index_against_record(c, l, dir);
    lc.values = l.record->value("values", nlohmann::json::object());
    const nlohmann::json recorded = l.record->value("tensors", nlohmann::json::object());
    for (auto it = recorded.begin(); it != recorded.end(); ++it)
      lc.shapes[it.key()] = {it.value()["dtype"].get<std::string>(), it.value()["shape"].get<std::vector<int64_t>>()};
    for (const auto& f : l.record->value("files", nlohmann::json::array()))
      lc.files[f.get<std::string>()] = dir + "/" + f.get<std::string>();
  }
  if (L.format_version < 2) {
    L.legacy_values = L.meta.value("state", nlohmann::json::object());
    for (auto it = L.meta["files"].begin(); it != L.meta["files"].end(); ++it)
      if (!tensor_files.count(it.key()) && it.key().rfind("rank-", 0) != 0)
        L.legacy_files[it.key()] = dir + "/" + it.key();
  }
  read_tensors(L, dir, layouts, wants);
  if (rank < W) read_rank_file(L, dir, rank);
  return L;
}

}  // namespace

LoadedComponent Loaded::component(const std::string& name) const {
  LoadedComponent c;
  if (const auto it = components.find(name); it != components.end()) c = it->second;
  if (format_version >= 2) return c;
  // Format 1: the shared slots, as every component saw them then.
  c.values = legacy_values;
  if (name != "files" && name != "state" && meta.contains(name) && meta[name].is_object()) c.values.update(meta[name]);
  c.rank_values = legacy_rank_values;
  c.rank_tensors = legacy_rank_tensors;
  c.files = legacy_files;
  return c;
}

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
      L = read_step(dir, rank_, opts_.wants);
      if (validate) problem = validate(L);
      if (!problem.empty()) problem = dir + "/" + kMeta + ": " + problem;
    } catch (const std::exception& e) {
      problem = e.what();
    }
    // Every rank the same verdict, naming the first rank's problem (a rank reads only the
    // owned tensors it wants: a damaged partition is seen by its reader alone).
    const dist::RankError failed = dist::first_error(*coll_, problem, "checkpoint load verdict");
    if (!failed) {
      last_committed_ = L.step;
      std::string read;
      for (const auto& [c, n] : L.files_read)
        read += (read.empty() ? "" : ", ") + c + ": " + std::to_string(n) + " of " + std::to_string(L.saved_world_size);
      logging::info(
          "checkpoint: {} (saved by {} rank(s)): this rank read and verified its rank file and, of each "
          "component's files, {}",
          dir, L.saved_world_size, read.empty() ? "none" : read);
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
