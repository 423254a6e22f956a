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

# reducer.hpp (c10d's DDP engine) includes a distributed-autograd header that Debian's
# libtorch-dev omits; a minimal stand-in is used only when the real one is missing.
include(CheckIncludeFileCXX)
set(_keel_ctx "torch/csrc/distributed/autograd/context/context.h")
find_file(KEEL_REAL_DIST_AUTOGRAD_CONTEXT ${_keel_ctx} PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT KEEL_REAL_DIST_AUTOGRAD_CONTEXT)
  message(STATUS "keel: ${_keel_ctx} missing from LibTorch; using cmake/stubs")
  target_include_directories(keel_deps INTERFACE $<BUILD_INTERFACE:${CMAKE_CURRENT_LIST_DIR}/stubs>)
endif()

# MPI is used only to bootstrap the TCPStore address under mpirun (dist/mpi_bootstrap.cpp).
find_package(MPI COMPONENTS C)
if(MPI_C_FOUND)
  target_link_libraries(keel_deps INTERFACE MPI::MPI_C)
  target_compile_definitions(keel_deps INTERFACE KEEL_WITH_MPI=1)
endif()

# CUDA builds (upstream LibTorch with CUDA): NCCL process groups and CUDA graphs.
if(TORCH_CUDA_LIBRARIES OR CAFFE2_USE_CUDA)
  target_compile_definitions(keel_deps INTERFACE KEEL_WITH_CUDA=1)
endif()
