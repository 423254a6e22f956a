// libFuzzer target for a checkpoint step's meta.json and index (checkpoint/meta.h). Built and
// run by scripts/fuzz.sh; its corpus (tests/fuzz/corpus_meta) is replayed by ctest
// (CheckpointMeta.FuzzCorpusReplaysWithoutCrashing). The input is read as both files: the only
// acceptable failure is FormatError (anything else thrown, a crash or a sanitizer report is a
// finding), and an accepted meta.json must hold what the loader then relies on.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/meta.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel::checkpoint;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json meta = parse_meta(text, "meta.json", "step_5");
    const int64_t w = meta["world_size"].get<int64_t>();
    if (meta["step"].get<int64_t>() != 5 || w < 1 || w > static_cast<int64_t>(meta["files"].size())) std::abort();
    for (auto it = meta["files"].begin(); it != meta["files"].end(); ++it)
      if (!plain_name(it.key()) || !it.value()["sha256"].is_string()) std::abort();
  } catch (const FormatError&) {
  }
  try {
    parse_index(text, "model.safetensors.index.json",
                {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
  } catch (const FormatError&) {
  }
  return 0;
}
