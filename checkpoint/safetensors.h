// checkpoint/safetensors.h: LibTorch tensors to and from safetensors files.
//
// Owns: the dtype mapping (F32, F64, F16, BF16, I64, I32, I16, I8, U8, BOOL), writing a file
// atomically with its SHA-256 computed on the way (checkpoint/io.h), and reading a file back
// with every check of checkpoint/safetensors_header.h plus, when asked, its checksum.
// Tensors are written little-endian, row-major, from CPU copies of any device.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/io.h"
#include "checkpoint/safetensors_header.h"
#include "keel/checkpoint/checkpoint.h"  // NamedTensors

namespace keel::checkpoint {

/// "F32" for torch::kFloat, ...; throws FormatError for a dtype safetensors cannot hold.
std::string safetensors_dtype(c10::ScalarType t);
/// The inverse; throws FormatError for names LibTorch has no type for.
c10::ScalarType scalar_type_of(const std::string& dtype);

struct WriteOptions {
  /// AtomicFile::before_write of the file (a seam for tests and fault injection); may be empty.
  WriteCheck before_write;
};

/// Writes `tensors` (in this order) with `metadata` to `path` atomically; returns its size and
/// SHA-256. Names must be unique.
WrittenFile write_safetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {}, const WriteOptions& opts = {});

struct SafetensorsFile {
  Header header;
  NamedTensors tensors;  // CPU tensors, in data order
  uint64_t bytes = 0;
  std::string sha256;  // computed when read_safetensors was asked to
};

/// Reads and checks `path`. With `expected_sha256` non-empty, the file's checksum must match
/// (FormatError naming the file otherwise). Throws FormatError for a malformed file and
/// std::runtime_error when it cannot be read.
SafetensorsFile read_safetensors(const std::string& path, const std::string& expected_sha256 = "",
                                 bool load_tensors = true);

}  // namespace keel::checkpoint
