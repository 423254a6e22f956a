// common/host_copy.h: reading values a device computes without making the host wait for them
// at the point the copy is issued. The copy goes to pinned host memory with non_blocking = true
// and an event is recorded behind it on the current stream; get() waits for that event only
// (not for the stream or the device), so a value read one step late costs nothing in a steady
// state. On the CPU the values are there at once. Not installed: keel's own.
#pragma once

#include <c10/core/Event.h>
#include <torch/torch.h>

#include <memory>

namespace keel {

class HostCopy {
 public:
  HostCopy() = default;
  /// Starts copying `t` to the host; a CPU tensor is kept as it is (no copy).
  static HostCopy start(const torch::Tensor& t);
  /// The values on the host, waiting for the copy when it has not finished.
  const torch::Tensor& get();
  bool valid() const { return host_.defined(); }

 private:
  torch::Tensor host_;
  std::shared_ptr<c10::Event> done_;  // null: host_ holds the values already
};

}  // namespace keel
