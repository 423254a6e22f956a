#include "keel/dist/process_group.h"

#include <unistd.h>

#include <algorithm>
#include <stdexcept>

#include "common/log.h"
#include "keel/common/error.h"

#include "dist/compat.h"
#include "dist/mpi_bootstrap.h"
#include "dist/network.h"

namespace keel::dist {
namespace {

bool is_loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

std::string local_hostname() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "127.0.0.1";
  return buf;
}

// Ranks that are named one by one when the rendezvous fails (above, the count is given).
constexpr int64_t kNameMissingUpTo = 4096;

// Every rank announces itself and counts itself in; the rank that completes the count opens
// the door, for which the others wait (one key, whatever the world size, within
// dist.timeout_s). A rank that never arrives is named in the error instead of leaving the
// others blocked forever.
void wait_for_all_ranks(c10d::Store& store, const World& w, std::chrono::milliseconds timeout,
                        const std::string& where) {
  // Keyed by the restart count: torchrun's agent store outlives a restart, the keys of the
  // previous round must not count.
  const std::string prefix = "keel/" + std::to_string(w.restart_count) + "/joined/";
  store.set(prefix + std::to_string(w.rank), std::vector<uint8_t>{1});
  if (store.add(prefix + "count", 1) == w.size) store.set(prefix + "all", std::vector<uint8_t>{1});
  try {
    store.wait({prefix + "all"}, timeout);
  } catch (const std::exception&) {
    const int64_t joined = store.add(prefix + "count", 0);
    std::string who;
    if (w.size <= kNameMissingUpTo) {
      for (int64_t r = 0; r < w.size; ++r)
        if (!store.check({prefix + std::to_string(r)})) who += (who.empty() ? "" : ", ") + std::to_string(r);
      who = "rank(s) " + who + " of " + std::to_string(w.size) + " never joined";
    } else {
      who = std::to_string(w.size - joined) + " of " + std::to_string(w.size) + " ranks never joined";
    }
    throw std::runtime_error("rendezvous at " + where + " timed out after " + std::to_string(timeout.count() / 1000) +
                             " s (dist.timeout_s): " + who);
  }
}

}  // namespace

std::string resolve_backend(Backend backend, const torch::Device& device) {
  if (backend == Backend::Gloo) return "gloo";
  if (backend == Backend::Nccl || (backend == Backend::Auto && device.is_cuda())) {
#ifndef KEEL_WITH_CUDA
    throw InputError("dist.backend = \"nccl\" needs a CUDA build of keel; this build is CPU-only");
#else
    if (!device.is_cuda())
      throw InputError(
          "dist.backend = \"nccl\" needs CUDA devices, but run.device resolved to " + device.str() +
          (torch::cuda::is_available() ? "" : " (no GPU on this machine): use dist.backend = \"gloo\" or \"auto\""));
    return "nccl";
#endif
  }
  return "gloo";
}

std::shared_ptr<Group> Group::create(const World& world, const DistConfig& cfg, const torch::Device& device) {
  std::shared_ptr<Group> g(new Group());
  g->world_ = world;
  g->timeout_ = std::chrono::milliseconds(cfg.timeout_s * 1000);
  // Resolved at every world size, so that dist.backend = "nccl" without a GPU is refused
  // even for one process.
  const std::string backend = resolve_backend(cfg.backend, device);
  if (world.size == 1 && cfg.backend == Backend::Auto) return g;  // no process group: backend() stays "none"
  g->backend_ = backend;
  // Checked before the rendezvous: a wrong name fails at once, on the rank whose host lacks it.
  const InterfaceChoice iface = choose_interface(cfg.interface);
#ifdef KEEL_WITH_CUDA
  if (!iface.names.empty() && !std::getenv("NCCL_SOCKET_IFNAME")) {
    std::string list;
    for (const auto& n : iface.names) list += (list.empty() ? "" : ",") + n;
    ::setenv("NCCL_SOCKET_IFNAME", list.c_str(), 0);
  }
#endif

  std::string host = world.master_addr;
  uint16_t port = static_cast<uint16_t>(world.master_port);
  try {
    if (world.launcher == Launcher::Mpirun) {
      g->mpi_initialized_here_ = mpi_init();
      std::string addr;
      if (world.rank == 0) {
        // The store's address as the other hosts reach it: the named interface's, else the hostname.
        if (host.empty()) host = iface.names.empty() ? local_hostname() : interface_address(iface.names.front());
        g->store_ = compat::make_tcp_store(host, 0, /*is_server=*/true, world.size, g->timeout_);
        port = compat::tcp_store_port(g->store_);
        addr = host + ":" + std::to_string(port);
      }
      addr = mpi_broadcast_string(addr);
      host = addr.substr(0, addr.rfind(':'));
      port = static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
      if (world.rank != 0) g->store_ = compat::make_tcp_store(host, port, false, world.size, g->timeout_);
    } else if (world.launcher == Launcher::None) {
      // One process without a launcher and an explicit backend: a private store on loopback.
      host = "127.0.0.1";
      g->store_ = compat::make_tcp_store(host, 0, /*is_server=*/true, 1, g->timeout_);
      port = compat::tcp_store_port(g->store_);
    } else {
      // torchrun may host the store in its agent (TORCHELASTIC_USE_AGENT_STORE=True); then
      // every worker is a client.
      const bool server = world.rank == 0 && !world.agent_store;
      g->store_ = compat::make_tcp_store(host, port, server, world.size, g->timeout_);
      // The agent's store outlives a restart: without a per-attempt prefix, the restarted ranks
      // (the process group's own rendezvous included) read the dead attempt's keys, e.g. its
      // peers' addresses, and hang in Gloo's connectFullMesh or get "connection refused".
      // Same prefix as PyTorch's env:// rendezvous under torchrun.
      if (world.agent_store)
        g->store_ = compat::prefix_store("/worker/attempt_" + std::to_string(world.restart_count), g->store_);
    }
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw std::runtime_error(
        "rendezvous: cannot reach the TCPStore at " + host + ":" + std::to_string(port) + " (" +
        launcher_name(world.launcher) + "): " + what.substr(0, what.find('\n')) +
        "; check MASTER_ADDR and MASTER_PORT: rank 0 must be able to listen on that port and every "
        "rank to reach it (a port another program holds, or a firewall, gives this error)");
  }
  g->store_host_ = host;
  g->store_port_ = port;
  const std::string where = host + ":" + std::to_string(port);
  wait_for_all_ranks(*g->store_, world, g->timeout_, where);

  if (g->backend_ == "gloo") {
    // dist.interface or GLOO_SOCKET_IFNAME pick the interface(s); else loopback for a loopback
    // rendezvous, else the local address that routes to the store's host (the hostname's
    // address is often not one this host has: containers, network namespaces), else Gloo's
    // default (the hostname's).
    g->gloo_host_ = is_loopback(host) ? "127.0.0.1" : local_address_toward(host);
    g->interfaces_ = iface.names;
    g->pg_ = compat::make_gloo_group(g->store_, static_cast<int>(world.rank), static_cast<int>(world.size), g->timeout_,
                                     g->gloo_host_, iface.names);
  }
#ifdef KEEL_WITH_CUDA
  else {
    g->comm_device_ = device;
    g->pg_ =
        compat::make_nccl_group(g->store_, static_cast<int>(world.rank), static_cast<int>(world.size), g->timeout_);
  }
#endif
  std::string via;
  for (const auto& n : iface.names) via += (via.empty() ? "" : ",") + n;
  logging::info("process group: {} ranks over {} ({}), store {}, interface {}, timeout {} s", world.size, g->backend_,
                launcher_name(world.launcher), where, via.empty() ? "by route" : via + " (" + iface.source + ")",
                cfg.timeout_s);
  return g;
}

std::shared_ptr<Group> Group::subgroup(const std::vector<int64_t>& ranks, const std::string& name,
                                       std::vector<std::string> rank_names) const {
  const auto me = std::find(ranks.begin(), ranks.end(), world_.rank);
  if (me == ranks.end() || !std::is_sorted(ranks.begin(), ranks.end()))
    throw std::invalid_argument("process group " + name + ": rank " + std::to_string(world_.rank) +
                                " is not among its ranks, or they are not ascending");
  std::shared_ptr<Group> g(new Group());
  *g = *this;
  g->mpi_initialized_here_ = false;  // the world's group finalises MPI
  g->world_.rank = me - ranks.begin();
  g->world_.size = static_cast<int64_t>(ranks.size());
  g->rank_names_ = std::move(rank_names);
  g->name_ = name;
  g->subgroups_made_ = 0;
  if (ranks.size() == 1 || !pg_ || (backend_ != "gloo" && backend_ != "nccl")) {
    g->pg_.reset();
    g->store_.reset();
    g->backend_ = "none";
    return g;
  }
  g->store_ = compat::prefix_store("keel/group/" + std::to_string(subgroups_made_++) + "/" + name, store_);
  const int rank = static_cast<int>(g->world_.rank), size = static_cast<int>(g->world_.size);
  if (backend_ == "gloo") g->pg_ = compat::make_gloo_group(g->store_, rank, size, timeout_, gloo_host_, interfaces_);
#ifdef KEEL_WITH_CUDA
  else
    g->pg_ = compat::make_nccl_group(g->store_, rank, size, timeout_);
#endif
  return g;
}

std::string Group::rank_name(int64_t r) const {
  if (r >= 0 && r < static_cast<int64_t>(rank_names_.size())) return rank_names_[static_cast<size_t>(r)];
  return "rank " + std::to_string(r);
}

bool Group::store_reachable(std::chrono::milliseconds timeout) const {
  return store_ && can_connect(store_host_, store_port_, timeout);
}

Group::~Group() {
  pg_.reset();
  store_.reset();
  if (mpi_initialized_here_) mpi_finalize();
}

}  // namespace keel::dist
