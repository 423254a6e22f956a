# Finds keel's dependencies and gathers them in one INTERFACE target, keel_deps.
# Everything is from Debian packages (scripts/setup.sh installs them) or, for GPU builds,
# an upstream LibTorch pointed to by CMAKE_PREFIX_PATH / Torch_DIR.

find_package(Torch REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(ZLIB REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 QUIET CONFIG)
find_path(TOMLPP_INCLUDE_DIR toml++/toml.h REQUIRED)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
endif()

add_library(keel_deps INTERFACE)
target_link_libraries(keel_deps INTERFACE
  ${TORCH_LIBRARIES} Threads::Threads OpenSSL::Crypto ZLIB::ZLIB spdlog::spdlog
  nlohmann_json::nlohmann_json)
if(CLI11_FOUND)
  target_link_libraries(keel_deps INTERFACE CLI11::CLI11)
else()
  target_include_directories(keel_deps INTERFACE ${CLI11_INCLUDE_DIR})
endif()
target_include_directories(keel_deps INTERFACE ${TOMLPP_INCLUDE_DIR})
# toml++ is used header-only; keep it that way so the shared libtomlplusplus is optional.
target_compile_definitions(keel_deps INTERFACE TOML_HEADER_ONLY=1 TOML_EXCEPTIONS=1)
