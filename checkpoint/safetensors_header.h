// checkpoint/safetensors_header.h: the safetensors header, parsed and checked; no LibTorch.
//
// Format (huggingface/safetensors): an 8-byte little-endian u64 N, then N bytes of UTF-8
// JSON (an object; writers pad it with spaces so the data starts 8-byte aligned), then the
// data buffer. Each entry {"dtype", "shape", "data_offsets": [begin, end]} is relative to the
// buffer, little-endian, row-major; the entries tile the buffer exactly (no holes, no
// overlap). An optional "__metadata__" maps strings to strings.
//
// parse_safetensors_header() refuses, with a FormatError that says what is wrong, every way a
// header can be bad: a file shorter than 8 bytes, N over 100 MB or past the end of the file,
// invalid UTF-8 or JSON, a non-object, an unknown dtype, a negative or non-integer dimension,
// a shape whose byte count overflows or differs from its offsets, offsets out of range,
// overlapping or leaving holes, a non-string metadata value. It never reads outside the bytes
// it is given. tests/fuzz/ fuzzes it with libFuzzer; tests/test_checkpoint.cpp replays the
// corpus.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace keel::checkpoint {

/// A malformed checkpoint file; the message names the file (when known) and the problem.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // what the reference readers accept

struct TensorInfo {
  std::string name;
  std::string dtype;  // "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data buffer
};

struct Header {
  std::vector<TensorInfo> tensors;  // in data order (sorted by begin)
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data buffer (8 + N)
  uint64_t data_size = 0;   // bytes of the data buffer
};

/// Bytes per element of a safetensors dtype name; 0 for an unknown name.
size_t dtype_size(const std::string& dtype);

/// Parses the header at the start of `bytes` (at least the first 8 + N bytes of a file whose
/// total size is `file_size`). `what` names the file in errors.
Header parse_safetensors_header(const uint8_t* bytes, size_t size, uint64_t file_size, const std::string& what);

/// Serializes a header for `tensors` (whose offsets must tile [0, data_size)) with `metadata`,
/// padded with spaces so that 8 + N is a multiple of 8. Returns the 8 + N bytes.
std::string make_safetensors_header(const std::vector<TensorInfo>& tensors,
                                    const std::map<std::string, std::string>& metadata);

}  // namespace keel::checkpoint
