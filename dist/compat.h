// dist/compat.h: the one place where dist/ deals with LibTorch version differences.
//
// keel builds against Debian's LibTorch 1.13 (CPU, Gloo) and upstream LibTorch 2.x (CUDA,
// NCCL). What differs (../shared/notes/libtorch-compat.md):
//   - 1.13: ProcessGroupGloo *is* a c10d::ProcessGroup. 2.x: Gloo and NCCL are c10d::Backend
//     objects wrapped in a ProcessGroup (constructor arguments changed again around 2.6).
//   - TCPStore: the options struct gains fields; only the struct form is used here.
//   - c10d::Reducer: 2.8 drops per_bucket_size_limits and appends new trailing arguments.
// Everything else in dist/ calls these helpers and never tests versions itself.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/version.h>
#ifdef KEEL_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <string>
#include <unordered_map>
#include <vector>

namespace keel::dist::compat {

#define KEEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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

inline uint16_t tcp_store_port(const c10::intrusive_ptr<c10d::Store>& store) {
  return static_cast<c10d::TCPStore*>(store.get())->getPort();
}

#if KEEL_TORCH_AT_LEAST(2, 0)
// 2.x: a backend (Gloo, NCCL) serves collectives only inside a c10d::ProcessGroup.
template <class BackendT>
c10::intrusive_ptr<c10d::ProcessGroup> wrap_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    c10::intrusive_ptr<BackendT> backend, const char* name,
                                                    c10::DeviceType device, c10d::ProcessGroup::BackendType type) {
#if KEEL_TORCH_AT_LEAST(2, 6)
  (void)name;
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
#else
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size,
                                                    c10::make_intrusive<c10d::ProcessGroup::Options>(name));
#endif
  pg->setBackend(device, type, backend);
  pg->setDefaultBackend(type);
  return pg;
}
#endif

inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                              int rank, int size,
                                                              std::chrono::milliseconds timeout,
                                                              const std::string& hostname,
                                                              const std::string& interface) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(!interface.empty() ? c10d::ProcessGroupGloo::createDeviceForInterface(interface)
                          : !hostname.empty() ? c10d::ProcessGroupGloo::createDeviceForHostname(hostname)
                                              : c10d::ProcessGroupGloo::createDefaultDevice());
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
#if KEEL_TORCH_AT_LEAST(2, 0)
  return wrap_backend(store, rank, size, gloo, "gloo", c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO);
#else
  return gloo;
#endif
}

#ifdef KEEL_WITH_CUDA
inline c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                              int rank, int size,
                                                              std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
#if KEEL_TORCH_AT_LEAST(2, 0)
  return wrap_backend(store, rank, size, nccl, "nccl", c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL);
#else
  return nccl;
#endif
}
#endif

inline std::unique_ptr<c10d::Reducer> make_reducer(std::vector<at::Tensor> params,
                                                   std::vector<std::vector<size_t>> bucket_indices,
                                                   std::vector<size_t> per_bucket_size_limits,
                                                   c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                   int64_t bucket_bytes_cap, bool find_unused,
                                                   std::unordered_map<size_t, std::string> names,
                                                   int64_t first_bucket_bytes_cap) {
  std::vector<bool> sparse(params.size(), false);
#if KEEL_TORCH_AT_LEAST(2, 8)
  (void)per_bucket_size_limits;
  return std::make_unique<c10d::Reducer>(std::move(params), std::move(bucket_indices), std::move(pg),
                                         std::move(sparse), bucket_bytes_cap, find_unused,
                                         /*gradient_as_bucket_view=*/true, std::move(names),
                                         first_bucket_bytes_cap, /*skip_all_reduce_unused_params=*/false,
                                         /*use_python_reducer=*/false);
#else
  return std::make_unique<c10d::Reducer>(std::move(params), std::move(bucket_indices),
                                         std::move(per_bucket_size_limits), std::move(pg), std::move(sparse),
                                         bucket_bytes_cap, find_unused, /*gradient_as_bucket_view=*/true,
                                         std::move(names), first_bucket_bytes_cap);
#endif
}

}  // namespace keel::dist::compat
