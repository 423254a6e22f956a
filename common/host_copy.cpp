#include "common/host_copy.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace keel {

HostCopy HostCopy::start(const torch::Tensor& t) {
  HostCopy c;
  if (t.device().is_cpu()) {
    c.host_ = t;
    return c;
  }
  c.host_ = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  c.host_.copy_(t, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  c.done_ = std::make_shared<c10::Event>(t.device().type());
  c.done_->record(impl.getStream(t.device()));
  return c;
}

const torch::Tensor& HostCopy::get() {
  if (done_) {
    // cudaEventSynchronize: waits for this copy only; CUDA's sync debug mode does not count it
    // as a synchronisation of the stream or the device.
    if (!done_->query()) done_->synchronize();
    done_.reset();
  }
  return host_;
}

}  // namespace keel
