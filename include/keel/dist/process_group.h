// keel/dist/process_group.h: rendezvous and the process group of a job.
//
// Owns: building the TCPStore (torchrun/srun: at MASTER_ADDR:MASTER_PORT; mpirun: rank 0
// opens it on a free port and shares the address through MPI), checking that every rank
// joined (naming the ones that did not), and creating the c10d process group (Gloo on CPU,
// NCCL for CUDA devices) behind dist/compat.h. dist.timeout_s bounds the rendezvous and every
// collective.
// Does not own: issuing collectives (dist/collectives.h is the only door to the group).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "keel/dist/config.h"
#include "keel/dist/world.h"

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}  // namespace c10d

namespace keel::dist {

class Group {
 public:
  /// Rendezvous for `world` and create its process group. For world.size == 1 with
  /// dist.backend = "auto" no store or group is created (collectives are then local no-ops);
  /// an explicit backend builds a one-rank group (as PyTorch's DDP does at world 1), so that
  /// NCCL or Gloo is exercised on a single device. Throws InputError for a bad
  /// backend choice, std::runtime_error (naming the address and missing ranks) when the
  /// rendezvous fails or times out.
  static std::shared_ptr<Group> create(const World& world, const DistConfig& cfg, const torch::Device& device);
  ~Group();

  int64_t rank() const { return world_.rank; }
  int64_t size() const { return world_.size; }
  const World& world() const { return world_; }
  const std::string& backend() const { return backend_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Where the backend wants tensors: the rank's CUDA device for NCCL, else the CPU.
  const torch::Device& comm_device() const { return comm_device_; }
  /// The c10d group; null for one rank without an explicit backend.
  const c10::intrusive_ptr<c10d::ProcessGroup>& pg() const { return pg_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  /// host:port of the TCPStore ("" without one).
  std::string store_address() const {
    return store_host_.empty() ? "" : store_host_ + ":" + std::to_string(store_port_);
  }
  /// Whether the store's host answers within `timeout` (a fresh connection): false when that
  /// host is lost or cut off from this one, where a store operation would block for
  /// dist.timeout_s.
  bool store_reachable(std::chrono::milliseconds timeout) const;
  /// Whether rank 0's process serves the store (else torchrun's agent does).
  bool store_on_rank0() const { return !world_.agent_store; }

  /// A group of some of this group's ranks: `ranks` (ascending, this rank among them), made by
  /// each of its members (and by no other rank) on a prefix `name` of this group's store, with
  /// the same backend; its own rank() and size() count its members. `rank_names` name each member
  /// in messages (empty: "rank r"). One rank alone gets a group without a c10d group (local
  /// no-ops). Throws std::invalid_argument when this rank is not in `ranks`.
  std::shared_ptr<Group> subgroup(const std::vector<int64_t>& ranks, const std::string& name,
                                  std::vector<std::string> rank_names = {}) const;
  /// How messages name member `r` of this group: "rank r", or the name subgroup() was given.
  std::string rank_name(int64_t r) const;
  /// "world", or the name subgroup() was given (a mesh axis's: "tp/2").
  const std::string& name() const { return name_; }

 private:
  Group() = default;
  World world_;
  std::string backend_ = "none";
  std::chrono::milliseconds timeout_{300000};
  torch::Device comm_device_{torch::kCPU};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  bool mpi_initialized_here_ = false;
  std::string store_host_;
  uint16_t store_port_ = 0;
  std::string gloo_host_;                // the address Gloo binds (subgroups bind the same)
  std::vector<std::string> interfaces_;  // dist.interface's, for Gloo
  std::vector<std::string> rank_names_;  // subgroup(): each member's name in messages
  std::string name_ = "world";
  mutable int64_t subgroups_made_ = 0;  // in each subgroup's store prefix: a name made twice meets no stale keys
};

/// "gloo" or "nccl" for `backend` on `device`. Throws InputError
/// for nccl without CUDA, or nccl on a CPU device.
std::string resolve_backend(Backend backend, const torch::Device& device);

}  // namespace keel::dist
