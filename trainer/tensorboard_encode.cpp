#include "trainer/tensorboard_encode.h"

#include "tensorboard_event.pb.h"

namespace keel::tensorboard {

std::string encode_file_version(double wall_time) {
  Event e;
  e.set_wall_time(wall_time);
  e.set_file_version("brain.Event:2");
  return e.SerializeAsString();
}

std::string encode_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* summary = e.mutable_summary();
  for (const auto& [tag, v] : values) {
    auto* value = summary->add_value();
    value->set_tag(tag);
    value->set_simple_value(static_cast<float>(v));
  }
  return e.SerializeAsString();
}

std::string encode_session_start(double wall_time, int64_t step) {
  Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  e.mutable_session_log()->set_status(SessionLog::START);
  return e.SerializeAsString();
}

}  // namespace keel::tensorboard
