// dist/compat.h: the one place where dist/ builds c10d objects (LibTorch >= 2.11).
//
// Owns: TCPStore, a Gloo or NCCL backend wrapped in the c10d::ProcessGroup that serves it, and
// c10d::Reducer. Their constructors are the parts of c10d whose signatures move between
// releases (Reducer's changed in 2.0, 2.8 and 2.11), so they are spelled once, here.
// Not installed: users never see it.
#pragma once

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#ifdef KEEL_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <string>
#include <unordered_map>
#include <vector>

namespace keel::dist::compat {

inline c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, uint16_t port, bool is_server,
                                                      size_t world, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = is_server;
  o.numWorkers = world;
  o.waitWorkers = false;  // keel waits for every rank itself, with a message naming the missing ones
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, o);
}

// Every key through `store` gets `prefix` + "/" in front (what the ranks of one attempt share).
inline c10::intrusive_ptr<c10d::Store> prefix_store(const std::string& prefix, c10::intrusive_ptr<c10d::Store> store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

inline uint16_t tcp_store_port(const c10::intrusive_ptr<c10d::Store>& store) {
  return static_cast<c10d::TCPStore*>(store.get())->getPort();
}

// A backend (Gloo, NCCL) serves collectives only inside a c10d::ProcessGroup.
template <class BackendT>
c10::intrusive_ptr<c10d::ProcessGroup> wrap_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    c10::intrusive_ptr<BackendT> backend, c10::DeviceType device,
                                                    c10d::ProcessGroup::BackendType type) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setBackend(device, type, backend);
  pg->setDefaultBackend(type);
  return pg;
}

inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                              int size, std::chrono::milliseconds timeout,
                                                              const std::string& hostname,
                                                              const std::vector<std::string>& interfaces) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  for (const auto& i : interfaces) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(i));
  if (opts->devices.empty())
    opts->devices.push_back(!hostname.empty() ? c10d::ProcessGroupGloo::createDeviceForHostname(hostname)
                                              : c10d::ProcessGroupGloo::createDefaultDevice());
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  auto pg = wrap_backend(store, rank, size, gloo, c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO);
  // Gloo also serves CUDA tensors (it stages them through host memory): two ranks on one GPU,
  // where NCCL refuses two ranks per device, use this.
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
  return pg;
}

#ifdef KEEL_WITH_CUDA
inline c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                              int size, std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  return wrap_backend(store, rank, size, nccl, c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL);
}
#endif

inline std::unique_ptr<c10d::Reducer> make_reducer(std::vector<at::Tensor> params,
                                                   std::vector<std::vector<size_t>> bucket_indices,
                                                   c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t bucket_bytes_cap,
                                                   bool find_unused, std::unordered_map<size_t, std::string> names,
                                                   int64_t first_bucket_bytes_cap) {
  std::vector<bool> sparse(params.size(), false);
  return std::make_unique<c10d::Reducer>(std::move(params), std::move(bucket_indices), std::move(pg), std::move(sparse),
                                         bucket_bytes_cap, find_unused,
                                         /*gradient_as_bucket_view=*/true, std::move(names), first_bucket_bytes_cap,
                                         /*skip_all_reduce_unused_params=*/false,
                                         /*use_python_reducer=*/false,
                                         /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
}

}  // namespace keel::dist::compat
