#include "checkpoint/safetensors.h"

#include <cstring>
#include <set>

namespace keel::checkpoint {

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "keel's safetensors writer assumes a little-endian host"
#endif

std::string safetensors_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return "F32";
    case c10::kDouble:
      return "F64";
    case c10::kHalf:
      return "F16";
    case c10::kBFloat16:
      return "BF16";
    case c10::kLong:
      return "I64";
    case c10::kInt:
      return "I32";
    case c10::kShort:
      return "I16";
    case c10::kChar:
      return "I8";
    case c10::kByte:
      return "U8";
    case c10::kBool:
      return "BOOL";
    default:
      throw FormatError(std::string("safetensors has no dtype for ") + c10::toString(t));
  }
}

c10::ScalarType scalar_type_of(const std::string& d) {
  static const std::map<std::string, c10::ScalarType> m = {
      {"F32", c10::kFloat}, {"F64", c10::kDouble}, {"F16", c10::kHalf}, {"BF16", c10::kBFloat16}, {"I64", c10::kLong},
      {"I32", c10::kInt},   {"I16", c10::kShort},  {"I8", c10::kChar},  {"U8", c10::kByte},       {"BOOL", c10::kBool}};
  auto it = m.find(d);
  if (it == m.end()) throw FormatError("dtype " + d + " has no LibTorch equivalent here");
  return it->second;
}

WrittenFile write_safetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata, const WriteOptions& opts) {
  std::vector<TensorInfo> infos;
  std::vector<torch::Tensor> cpu;
  std::set<std::string> seen;
  uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    if (!seen.insert(name).second) throw std::invalid_argument(path + ": tensor name \"" + name + "\" is used twice");
    if (name == "__metadata__") throw std::invalid_argument(path + ": \"__metadata__\" is not a tensor name");
    torch::Tensor c = t.detach();
    if (!c.device().is_cpu()) c = c.to(torch::kCPU);
    c = c.contiguous();
    TensorInfo i;
    i.name = name;
    i.dtype = safetensors_dtype(c.scalar_type());
    i.shape = c.sizes().vec();
    i.begin = at;
    i.end = at + static_cast<uint64_t>(c.numel()) * c.element_size();
    at = i.end;
    infos.push_back(std::move(i));
    cpu.push_back(std::move(c));
  }
  const std::string header = make_safetensors_header(infos, metadata);
  AtomicFile f(path);
  f.before_write(opts.before_write);
  f.write(header.data(), header.size());
  for (const auto& c : cpu) f.write(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  return f.commit();
}

SafetensorsFile read_safetensors(const std::string& path, const std::string& expected_sha256, bool load_tensors) {
  SafetensorsFile out;
  // Mapped, not read: the tensors are views of the page cache (copy-on-write), so a load costs
  // one pass for the checksum and one copy into the model, not a read plus copies.
  auto file = MappedFile::open(path);
  out.bytes = file->size();
  if (!expected_sha256.empty()) {
    out.sha256 = file->sha256();
    if (out.sha256 != expected_sha256)
      throw FormatError(path + ": checksum mismatch: SHA-256 " + out.sha256 + ", meta.json records " + expected_sha256 +
                        " (the file was changed or cut after the checkpoint was committed)");
  }
  const uint8_t* p = file->data();
  out.header = parse_safetensors_header(p, file->size(), file->size(), path);
  if (!load_tensors) return out;
  for (const auto& i : out.header.tensors) {
    const auto dtype = scalar_type_of(i.dtype);
    const uint64_t off = out.header.data_start + i.begin;
    const size_t es = c10::elementSize(dtype);
    torch::Tensor t;
    if (i.end > i.begin && off % es == 0) {
      // A view of the mapping; the mapping lives as long as any tensor of the file.
      t = torch::from_blob(
          file->data() + off, i.shape, [file](void*) {}, torch::TensorOptions().dtype(dtype));
    } else {
      // Misaligned for its dtype (another writer's layout), or empty: copied.
      t = torch::empty(i.shape, torch::TensorOptions().dtype(dtype));
      if (i.end > i.begin) std::memcpy(t.data_ptr(), p + off, i.end - i.begin);
    }
    out.tensors.emplace_back(i.name, std::move(t));
  }
  return out;
}

}  // namespace keel::checkpoint
