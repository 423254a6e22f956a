// trainer/tensorboard_encode.h: the Event messages of trainer/tensorboard_event.proto, encoded
// by protobuf into bytes. Compiled apart from the rest of keel (CMake target keel_tb_proto):
// LibTorch's include folder carries an older protobuf's headers, which must not meet Debian's
// libprotobuf that these functions are built and linked with. This header names no protobuf
// type, so that trainer/tensorboard.cpp (built with LibTorch's headers) can call it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace keel::tensorboard {

/// The first event of a file: file_version "brain.Event:2".
std::string encode_file_version(double wall_time);
/// One event of scalars (Summary.Value.simple_value, float32) at `step`.
std::string encode_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, double>>& values);
/// SessionLog START at `step`: TensorBoard drops what earlier files hold for steps >= `step`.
std::string encode_session_start(double wall_time, int64_t step);

}  // namespace keel::tensorboard
