#include "checkpoint/safetensors_header.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

namespace keel::checkpoint {
namespace {

[[noreturn]] void bad(const std::string& what, const std::string& msg) {
  throw FormatError(what + ": not a valid safetensors file: " + msg);
}

}  // namespace

size_t dtype_size(const std::string& d) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

Header parse_safetensors_header(const uint8_t* bytes, size_t size, uint64_t file_size, const std::string& what) {
  if (file_size < 8 || size < 8) bad(what, "shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeaderBytes) bad(what, "header length " + std::to_string(n) + " exceeds the 100 MB limit");
  if (n > file_size - 8)
    bad(what, "header length " + std::to_string(n) + " runs past the end of the " + std::to_string(file_size) +
                  "-byte file (truncated?)");
  if (n > size - 8) bad(what, "header length " + std::to_string(n) + " exceeds the bytes read");
  if (n < 2 || bytes[8] != '{') bad(what, "the header does not start with '{'");

  nlohmann::json j;
  try {
    // nlohmann's parser rejects invalid UTF-8 inside strings.
    j = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    bad(what, std::string("header is not valid UTF-8 JSON: ") + e.what());
  }
  if (!j.is_object()) bad(what, "the header is not a JSON object");

  Header h;
  h.data_start = 8 + n;
  h.data_size = file_size - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad(what, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad(what, "__metadata__[\"" + m.key() + "\"] is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor \"" + name + "\"";
    if (!v.is_object()) bad(what, where + " is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) bad(what, where + " has no string dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) bad(what, where + " has no shape array");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      bad(what, where + " has no [begin, end] data_offsets");
    TensorInfo t;
    t.name = name;
    t.dtype = v["dtype"].get<std::string>();
    const size_t es = dtype_size(t.dtype);
    if (es == 0) bad(what, where + " has unknown dtype \"" + t.dtype + "\"");
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) bad(what, where + " has a dimension that is not a non-negative integer");
      const uint64_t x = d.get<uint64_t>();
      if (x > (uint64_t(1) << 62)) overflow = true;
      t.shape.push_back(static_cast<int64_t>(x));
      if (x != 0 && numel > (uint64_t(1) << 62) / x) overflow = true;
      numel *= x;
    }
    if (overflow) bad(what, where + ": its shape's byte count overflows");
    for (const auto& o : v["data_offsets"])
      if (!o.is_number_unsigned()) bad(what, where + " has a data offset that is not a non-negative integer");
    t.begin = v["data_offsets"][0].get<uint64_t>();
    t.end = v["data_offsets"][1].get<uint64_t>();
    if (t.begin > t.end) bad(what, where + " has begin " + std::to_string(t.begin) + " > end " + std::to_string(t.end));
    if (t.end > h.data_size)
      bad(what, where + " ends at byte " + std::to_string(t.end) + " of a " + std::to_string(h.data_size) +
                    "-byte data buffer (out of range or truncated)");
    if (numel > UINT64_MAX / es || numel * es != t.end - t.begin)
      bad(what, where + ": dtype " + t.dtype + " and its shape need " + std::to_string(numel) + " x " +
                    std::to_string(es) + " bytes but its offsets hold " + std::to_string(t.end - t.begin));
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const auto& t : h.tensors) {
    if (t.begin < at)
      bad(what, "tensor \"" + t.name + "\" overlaps the tensor before it (begins at " + std::to_string(t.begin) +
                    ", previous ends at " + std::to_string(at) + ")");
    if (t.begin > at)
      bad(what, "a hole in the data buffer before tensor \"" + t.name + "\" (bytes " + std::to_string(at) + ".." +
                    std::to_string(t.begin) + ")");
    at = t.end;
  }
  if (at != h.data_size)
    bad(what, "the tensors cover " + std::to_string(at) + " of the " + std::to_string(h.data_size) +
                  " data bytes (trailing bytes or a wrong header)");
  return h;
}

std::string make_safetensors_header(const std::vector<TensorInfo>& tensors,
                                    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  for (const auto& t : tensors)
    j[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  std::string body = j.dump();
  while ((8 + body.size()) % 8 != 0) body.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = body.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

}  // namespace keel::checkpoint
