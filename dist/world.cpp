#include "keel/dist/world.h"

#include <cerrno>
#include <cstdlib>
#include <vector>

#include "keel/common/error.h"

extern char** environ;

namespace keel::dist {
namespace {

std::string found_list(const Env& env, const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) {
    auto it = env.find(k);
    if (it != env.end()) s += (s.empty() ? "" : ", ") + k + "=" + it->second;
  }
  return s.empty() ? "nothing" : s;
}

int64_t parse_int(const Env& env, const std::string& key, Launcher launcher) {
  const std::string& v = env.at(key);
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE || x < 0)
    throw InputError(std::string(launcher_name(launcher)) + " environment: " + key + "=\"" + v +
                     "\" is not a non-negative integer");
  return x;
}

void require(const Env& env, const std::vector<std::string>& required, const std::vector<std::string>& all,
             Launcher launcher) {
  std::string missing;
  for (const auto& k : required)
    if (!env.count(k)) missing += (missing.empty() ? "" : ", ") + k;
  if (!missing.empty())
    throw InputError("incomplete " + std::string(launcher_name(launcher)) + " environment: found " +
                     found_list(env, all) + "; missing " + missing);
}

void check_ranges(const World& w) {
  auto bad = [&](const std::string& m) {
    throw InputError("inconsistent " + std::string(launcher_name(w.launcher)) + " environment: " + m);
  };
  if (w.size < 1) bad("world size " + std::to_string(w.size) + " < 1");
  if (w.size > kMaxWorldSize)
    bad("world size " + std::to_string(w.size) + " is more than keel supports (" + std::to_string(kMaxWorldSize) + ")");
  if (w.rank >= w.size) bad("rank " + std::to_string(w.rank) + " >= world size " + std::to_string(w.size));
  if (w.local_size < 1 || w.local_size > w.size)
    bad("local world size " + std::to_string(w.local_size) + " is not in [1, " + std::to_string(w.size) + "]");
  if (w.local_rank >= w.local_size)
    bad("local rank " + std::to_string(w.local_rank) + " >= local world size " + std::to_string(w.local_size));
  if (w.master_port > 65535) bad("MASTER_PORT " + std::to_string(w.master_port) + " > 65535");
}

}  // namespace

Env current_env() {
  Env env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

World detect_world(const Env& env) {
  World w;
  const std::vector<std::string> torchrun_keys = {"RANK",
                                                  "WORLD_SIZE",
                                                  "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR",
                                                  "MASTER_PORT",
                                                  "TORCHELASTIC_RESTART_COUNT"};
  const std::vector<std::string> ompi_keys = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
  const std::vector<std::string> slurm_keys = {"SLURM_PROCID",          "SLURM_NTASKS", "SLURM_LOCALID",
                                               "SLURM_NTASKS_PER_NODE", "MASTER_ADDR",  "MASTER_PORT"};
  if (env.count("RANK") || env.count("WORLD_SIZE") || env.count("LOCAL_RANK")) {
    w.launcher = Launcher::Torchrun;
    require(env, {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}, torchrun_keys, w.launcher);
    w.rank = parse_int(env, "RANK", w.launcher);
    w.size = parse_int(env, "WORLD_SIZE", w.launcher);
    w.local_rank = env.count("LOCAL_RANK") ? parse_int(env, "LOCAL_RANK", w.launcher) : w.rank;
    w.local_size = env.count("LOCAL_WORLD_SIZE") ? parse_int(env, "LOCAL_WORLD_SIZE", w.launcher) : w.size;
    if (env.count("TORCHELASTIC_RESTART_COUNT"))
      w.restart_count = parse_int(env, "TORCHELASTIC_RESTART_COUNT", w.launcher);
    w.master_addr = env.at("MASTER_ADDR");
    w.master_port = parse_int(env, "MASTER_PORT", w.launcher);
    auto agent = env.find("TORCHELASTIC_USE_AGENT_STORE");
    w.agent_store = agent != env.end() && (agent->second == "True" || agent->second == "1");
  } else if (env.count("OMPI_COMM_WORLD_RANK") || env.count("OMPI_COMM_WORLD_SIZE")) {
    w.launcher = Launcher::Mpirun;
    require(env, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, ompi_keys, w.launcher);
    w.rank = parse_int(env, "OMPI_COMM_WORLD_RANK", w.launcher);
    w.size = parse_int(env, "OMPI_COMM_WORLD_SIZE", w.launcher);
    w.local_rank =
        env.count("OMPI_COMM_WORLD_LOCAL_RANK") ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", w.launcher) : 0;
    w.local_size =
        env.count("OMPI_COMM_WORLD_LOCAL_SIZE") ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", w.launcher) : 1;
    // Rank 0 opens the store on a free port and shares its address through MPI itself.
  } else if (env.count("SLURM_PROCID") && env.count("SLURM_NTASKS") && env.at("SLURM_NTASKS") != "1") {
    w.launcher = Launcher::Srun;
    require(env, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"}, slurm_keys,
            w.launcher);
    w.rank = parse_int(env, "SLURM_PROCID", w.launcher);
    w.size = parse_int(env, "SLURM_NTASKS", w.launcher);
    w.local_rank = parse_int(env, "SLURM_LOCALID", w.launcher);
    // SLURM_NTASKS_PER_NODE may read "2(x3)"; its leading number is the local size.
    w.local_size = env.count("SLURM_NTASKS_PER_NODE")
                       ? std::max<int64_t>(1, std::atoll(env.at("SLURM_NTASKS_PER_NODE").c_str()))
                       : w.size;
    w.local_size = std::min(w.local_size, w.size);
    w.master_addr = env.at("MASTER_ADDR");
    w.master_port = parse_int(env, "MASTER_PORT", w.launcher);
  }
  check_ranges(w);
  return w;
}

}  // namespace keel::dist
