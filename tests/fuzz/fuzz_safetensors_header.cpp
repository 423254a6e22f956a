// libFuzzer target for the safetensors header parser (checkpoint/safetensors_header.h).
// Built and run by scripts/fuzz.sh (clang -fsanitize=fuzzer,address,undefined); the corpus in
// tests/fuzz/corpus is replayed by ctest (SafetensorsHeader.FuzzCorpusReplaysWithoutCrashing).
// Beyond "no crash, no sanitizer report", an accepted header must satisfy the invariants the
// reader relies on: the tensors tile the data buffer exactly and each byte count matches.
#include <cstdint>
#include <cstdlib>

#include "checkpoint/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel::checkpoint;
  try {
    const Header h = parse_safetensors_header(data, size, size, "fuzz");
    uint64_t at = 0;
    for (const auto& t : h.tensors) {
      if (t.begin != at || t.end < t.begin) std::abort();
      uint64_t numel = 1;
      for (auto d : t.shape) numel *= static_cast<uint64_t>(d);
      if (numel * dtype_size(t.dtype) != t.end - t.begin) std::abort();
      at = t.end;
    }
    if (at != h.data_size || h.data_start + h.data_size != size) std::abort();
  } catch (const FormatError&) {
  }
  return 0;
}
