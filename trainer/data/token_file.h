// trainer/data/token_file.h: pre-tokenized corpora (data.name = "tokens"), read in place (pread).
//
// Owns: reading token files without loading them: llm.c's .bin format (a header of 256 int32:
// magic 20240520 with version 1 and uint16 tokens, or magic 20240801 with version 7 and uint32
// tokens; header[2] the token count) and raw little-endian uint16 / uint32 tokens
// (data.token_dtype); a glob of shards read as one corpus; the checks made at start (header,
// size, every token below the model's vocabulary: a parallel scan of the file) with an
// InputError naming the file; and the windows the model trains on (sample i: T + 1 tokens from
// i * T, inputs the first T, targets the last T, never across two files).
// Does not own: which windows a rank reads (trainer/data/sampler.h: each rank its own, the
// position in the checkpoint).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/trainer/data/data.h"

namespace keel::data {

/// One token file, open read-only and read with pread (never mapped: a file truncated under a
/// run is a runtime_error naming it, not a SIGBUS; one rewritten to a size that still holds
/// the window is read as it now is). Throws InputError naming `path` for a file that is not a
/// token file of `dtype` (TokenDtype::Auto: llm.c's header required).
class TokenFile {
 public:
  TokenFile(const std::string& path, TokenDtype dtype);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }          // tokens
  int width() const { return width_; }             // bytes per token: 2 or 4
  bool has_header() const { return header_ > 0; }  // an llm.c .bin file
  /// Tokens [start, start + n) as int64 into `out`. Throws runtime_error naming the file when it
  /// no longer holds them (truncated since it was checked).
  void read(int64_t start, int64_t n, int64_t* out) const;
  /// The first token >= `vocab` and where it is, or -1 (a parallel scan of the whole file).
  std::pair<int64_t, int64_t> first_at_or_above(int64_t vocab) const;

 private:
  std::string path_;
  int fd_ = -1;
  size_t header_ = 0;  // bytes before the tokens
  int width_ = 2;
  int64_t count_ = 0;
};

/// The files `pattern` names: itself when it has no glob characters, else its matches, sorted.
/// Throws InputError naming `key` when nothing matches.
std::vector<std::string> token_paths(const std::string& pattern, const std::string& key);

/// Splits of T-token windows (T = the model's sequence length) over data.path, and over
/// data.test_path or data.path's tail (data.test_fraction). Every file is checked at start.
Splits make_tokens(const DataConfig& cfg, const models::InputSpec& spec);

}  // namespace keel::data
