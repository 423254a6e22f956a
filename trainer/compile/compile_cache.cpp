#include "trainer/compile/compile_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/serialization/import.h>
#include "common/log.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/atomic_file.h"
#include "common/file.h"
#include "keel/common/error.h"
#include "keel/version.h"
#include "trainer/compile/packaging.h"

namespace keel {
namespace {

// SHA-256 of the code that runs, once per process: the executable and, when keel's own code is
// in a shared library (libkeel.so, keel::keel), that library too. A model's code (a built-in
// one or one a user registered in C++) is compiled into one of them, so a rebuilt model is a new
// key: the cache can never hand back the graph of older code.
const std::string& executable_sha256() {
  static const std::string h = [] {
    try {
      std::string code = sha256_hex(read_regular_file("/proc/self/exe", uint64_t(4) << 30));
      // The file mapped where this function's code is (/proc/self/maps names it absolutely):
      // libkeel.so when a program links keel::keel, else the executable itself.
      const auto here = reinterpret_cast<uintptr_t>(&executable_sha256);
      std::ifstream maps("/proc/self/maps");
      for (std::string line; std::getline(maps, line);) {
        uintptr_t lo = 0, hi = 0;
        if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || here < lo || here >= hi) continue;
        const size_t slash = line.find('/');
        const std::string lib = slash == std::string::npos ? "" : line.substr(slash);
        struct stat exe {
        }, so{};
        if (!lib.empty() && stat("/proc/self/exe", &exe) == 0 && stat(lib.c_str(), &so) == 0 &&
            (exe.st_dev != so.st_dev || exe.st_ino != so.st_ino))
          code += sha256_hex(read_regular_file(lib, uint64_t(4) << 30));
        break;
      }
      return code;
    } catch (const std::exception& e) {
      logging::warn("compile cache: cannot read this executable to identify its code ({}); caching off", e.what());
      return std::string();
    }
  }();
  return h;
}

}  // namespace

std::string compile_cache_key(const std::string& model_identity, const CompileConfig& cfg, const torch::Tensor& example,
                              const std::string& amp_dtype) {
  nlohmann::json k = {
      {"keel", KEEL_VERSION},
      {"torch", TORCH_VERSION},
      {"model", model_identity},
      {"input_shape", example.sizes().vec()},
      {"input_dtype", c10::toString(example.scalar_type())},
      {"device", example.device().str()},
      {"executable", executable_sha256()},
      {"mode", choice_name(kCompileModes, cfg.mode)},
      {"fullgraph", cfg.fullgraph},
      {"deterministic", cfg.deterministic},
      {"amp_dtype", amp_dtype},
  };
  if (executable_sha256().empty()) return "";
  return sha256_hex(k.dump());
}

CompileCache::CompileCache(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  const auto abs = std::filesystem::absolute(dir_, ec);  // as aot::cache_root: a later chdir changes nothing
  if (!ec) dir_ = abs.lexically_normal().string();
  if (const std::string err = make_dirs(dir_); !err.empty()) throw InputError("compile.cache_dir: " + err);
}

namespace {
// An entry's SHA-256, written beside it when it is stored and checked before it is read (issue 64:
// nothing is read back from the cache without its manifest).
std::string checksum_path(const std::string& entry) { return entry + ".sha256"; }
}  // namespace

std::shared_ptr<torch::jit::Graph> CompileCache::load(const std::string& key) const {
  const std::string path = entry_path(key);
  if (::access(path.c_str(), R_OK) != 0) return nullptr;
  aot::EntryLock lock(path + ".lock");  // the entry and its checksum as one writer left them
  try {
    const std::string sums = checksum_path(path);
    if (::access(sums.c_str(), R_OK) != 0) throw std::runtime_error("no checksum file " + sums);
    if (read_regular_file(sums, 1 << 10) != sha256_hex(read_regular_file(path, uint64_t(4) << 30)))
      throw std::runtime_error("its SHA-256 differs from " + sums + " (changed or damaged)");
    torch::jit::ExtraFilesMap extra{{"keel_meta.json", ""}};
    auto m = torch::jit::load(path, c10::nullopt, extra);
    auto meta = nlohmann::json::parse(extra.at("keel_meta.json"));
    if (meta.value("key", "") != key) throw std::runtime_error("entry belongs to key " + meta.value("key", "?"));
    auto graph = m.get_method("forward").graph()->copy();
    graph->eraseInput(0);  // `self`: the holder module has no state
    return graph;
  } catch (const std::exception& e) {
    std::string what = e.what();
    logging::warn("compile cache: entry {} is unreadable ({}); removing it and tracing again", path,
                  what.substr(0, what.find('\n')));
    std::remove(path.c_str());
    std::remove(checksum_path(path).c_str());
    return nullptr;
  }
}

void CompileCache::store(const std::string& key, torch::jit::Graph& graph, const std::string& meta_json) const {
  const std::string path = entry_path(key);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    // A graph becomes a method of an empty module, so TorchScript's own format carries it.
    torch::jit::Module holder(c10::QualifiedName("__torch__.keel.CompiledForward"));
    auto g = graph.copy();
    g->insertInput(0, "self")->setType(holder._ivalue()->type());
    auto* fn =
        holder._ivalue()->compilation_unit()->create_function(c10::QualifiedName(*holder.type()->name(), "forward"), g);
    holder.type()->addMethod(fn);
    holder.save(tmp, {{"keel_meta.json", meta_json}});
    int fd = ::open(tmp.c_str(), O_RDONLY);
    if (fd < 0 || ::fsync(fd) != 0) throw std::runtime_error("fsync failed");
    ::close(fd);
    // The checksum first: an entry is read only with one that matches it. Ranks that store the
    // same key at once take turns, so an entry never pairs with another writer's checksum.
    const std::string sum = sha256_hex(read_regular_file(tmp, uint64_t(4) << 30));
    aot::EntryLock lock(path + ".lock");
    write_atomic(checksum_path(path), sum);
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("rename failed");
  } catch (const std::exception& e) {
    std::remove(tmp.c_str());
    std::string what = e.what();
    logging::warn("compile cache: cannot write {}: {}", path, what.substr(0, what.find('\n')));
  }
}

}  // namespace keel
