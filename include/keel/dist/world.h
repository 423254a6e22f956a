// keel/dist/world.h: who this process is in the job, read from the launcher's environment.
//
// Owns: detecting the launcher (torchrun, mpirun/OpenMPI, Slurm srun, or none) and this
// process's rank, world size, local rank and restart count; refusing a partial or inconsistent
// environment with a message that lists what was found.
// Does not own: rendezvous and process groups (the rest of dist/).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "keel/common/choices.h"
#include "keel/common/error.h"

namespace keel::dist {

/// The largest world detect_world() accepts (beyond any job run today; the bound keeps an
/// absurd WORLD_SIZE from sizing anything).
constexpr int64_t kMaxWorldSize = int64_t{1} << 18;

/// Who started this process (detect_world reads it from the environment); compared as a value,
/// named through kLaunchers ("none" for a process started alone).
enum class Launcher { None, Torchrun, Mpirun, Srun };
inline constexpr Choices<Launcher, 4> kLaunchers{{{"none", Launcher::None},
                                                  {"torchrun", Launcher::Torchrun},
                                                  {"mpirun", Launcher::Mpirun},
                                                  {"srun", Launcher::Srun}}};
inline const char* launcher_name(Launcher l) { return choice_name(kLaunchers, l); }

struct World {
  int64_t rank = 0;
  int64_t size = 1;
  int64_t local_rank = 0;
  int64_t local_size = 1;
  int64_t restart_count = 0;  // TORCHELASTIC_RESTART_COUNT (0 for other launchers)
  Launcher launcher = Launcher::None;
  std::string master_addr;   // rendezvous host (torchrun, srun)
  int64_t master_port = 0;   // rendezvous port (torchrun, srun)
  bool agent_store = false;  // torchrun hosts the store itself (TORCHELASTIC_USE_AGENT_STORE)
  bool is_main() const { return rank == 0; }
};

using Env = std::map<std::string, std::string>;

/// A snapshot of this process's environment.
Env current_env();

/// Detects the launcher from `env`. Precedence: torchrun's variables (RANK, WORLD_SIZE, ...),
/// then OpenMPI's (OMPI_COMM_WORLD_*), then Slurm's (SLURM_PROCID, SLURM_NTASKS, ...), else a
/// single process. Throws keel::InputError for a partial or inconsistent environment.
World detect_world(const Env& env);

}  // namespace keel::dist
