# Finds keel's dependencies and gathers them in two INTERFACE targets, keel_public_deps and keel_deps.
#
# LibTorch: PyTorch 2.11's, from PyPI's torch wheel (scripts/setup.sh installs it into
# ${KEEL_VENV:-$HOME/.cache/keel/venv} and passes torch.utils.cmake_prefix_path), or any
# LibTorch >= 2.11 the user points Torch_DIR at. Everything else comes from Debian packages.
# docs/building.md says what was tested and why each choice was made.

# The wheel is a CUDA 13.0 build: Caffe2's cuda.cmake needs a toolkit even to link a CPU-only
# consumer. Use /usr/local/cuda unless the user chose one.
if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
# cuda.cmake detects the GPUs of the build machine with a try_run of CUDA code, which CMake 3.25
# cannot configure with CMAKE_CXX_STANDARD 20 (no "CUDA20" dialect for nvcc). keel compiles no
# CUDA kernels, so the architecture list only has to be set, not right.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
# Caffe2's cuda.cmake stops on a missing cuDNN in some versions and warns in others; keel never
# calls cuDNN itself.
find_package(Torch REQUIRED)
if(Torch_VERSION VERSION_LESS 2.11)
  message(FATAL_ERROR "keel needs LibTorch >= 2.11; ${Torch_DIR} is ${Torch_VERSION}. "
                      "Run scripts/setup.sh (it installs torch==2.11.0 into a venv) or point Torch_DIR at a newer one.")
endif()
find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(ZLIB REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 QUIET CONFIG)
find_path(TOMLPP_INCLUDE_DIR toml++/toml.h REQUIRED)
# TensorBoard event files: protobuf (lite runtime) encodes the messages, Boost.CRC the CRC32C.
find_package(Protobuf REQUIRED)
find_package(Boost REQUIRED)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
endif()

# Two interface targets. keel_public_deps: what a user of the installed library needs too
# (LibTorch, Threads, nlohmann_json: the public headers name them), exported with keel's
# package. keel_deps: that plus everything keel's own sources use privately (spdlog, protobuf,
# OpenSSL, zlib, MPI, toml++, CLI11, Gloo's and NCCL's headers); build-only, never exported, so
# that linking keel::keel needs none of them (docs/building.md).
add_library(keel_public_deps INTERFACE)
add_library(keel_deps INTERFACE)
target_link_libraries(keel_deps INTERFACE keel_public_deps)
# The torch wheel's libtorch.so and libtorch_cpu.so export pieces of a newer libstdc++ that
# they link statically (std::filesystem, std::chrono::tzdb, stringbuf::str; pytorch#133437).
# A binary whose DT_NEEDED list names libtorch before libstdc++ binds those std:: calls to
# libtorch's copies: std::filesystem::remove_all then jumps to address 0. Naming the system
# libstdc++ first (before any object or library on the link line) makes the dynamic linker
# bind every std:: symbol to it. tests/link_check.sh checks the order.
target_link_options(keel_public_deps INTERFACE "LINKER:--push-state,--no-as-needed" "-lstdc++" "LINKER:--pop-state")
target_link_libraries(keel_public_deps INTERFACE ${TORCH_LIBRARIES} Threads::Threads nlohmann_json::nlohmann_json)
target_link_libraries(keel_deps INTERFACE OpenSSL::Crypto ZLIB::ZLIB
  # Only the link: spdlog's headers and Debian's fmt stay out of keel's own translation units
  # (common/log.h says why); keel formats with LibTorch's fmt, header-only.
  $<LINK_ONLY:spdlog::spdlog> $<LINK_ONLY:protobuf::libprotobuf-lite>)
target_compile_definitions(keel_deps INTERFACE FMT_HEADER_ONLY=1)
if(CLI11_FOUND)
  target_link_libraries(keel_deps INTERFACE CLI11::CLI11)
else()
  target_include_directories(keel_deps INTERFACE $<BUILD_INTERFACE:${CLI11_INCLUDE_DIR}>)
endif()
# No installed header includes toml++ or CLI11: build-only include paths.
target_include_directories(keel_deps INTERFACE $<BUILD_INTERFACE:${TOMLPP_INCLUDE_DIR}>)
# toml++ is used header-only; keep it that way so the shared libtomlplusplus is optional.
target_compile_definitions(keel_deps INTERFACE TOML_HEADER_ONLY=1 TOML_EXCEPTIONS=1)

# The site-packages folder of a wheel LibTorch (torch/share/cmake/Torch -> site-packages), empty
# for a LibTorch unpacked elsewhere.
get_filename_component(_keel_site "${Torch_DIR}/../../../.." ABSOLUTE)
if(NOT EXISTS "${_keel_site}/torch/__init__.py")
  set(_keel_site "")
endif()

# Gloo: the wheel builds Gloo into libtorch_cpu and ships none of its headers, while
# ProcessGroupGloo.hpp includes <gloo/...>. keel takes the declarations from Debian's
# libgloo-dev (headers only: no second Gloo library is linked) and touches Gloo only through
# shared_ptr<gloo::transport::Device> handles made by libtorch_cpu (docs/building.md).
find_path(KEEL_GLOO_INCLUDE_DIR gloo/transport/device.h PATHS ${TORCH_INCLUDE_DIRS})
if(NOT KEEL_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "keel: Gloo headers (gloo/transport/device.h) not found: install Debian's libgloo-dev "
                      "(scripts/setup.sh does) or set KEEL_GLOO_INCLUDE_DIR")
endif()
target_include_directories(keel_deps SYSTEM INTERFACE $<BUILD_INTERFACE:${KEEL_GLOO_INCLUDE_DIR}>)

# MPI is used only to bootstrap the TCPStore address under mpirun (dist/mpi_bootstrap.cpp).
find_package(MPI COMPONENTS C)
if(MPI_C_FOUND)
  target_link_libraries(keel_deps INTERFACE MPI::MPI_C)
  target_compile_definitions(keel_deps INTERFACE KEEL_WITH_MPI=1)
endif()

# CUDA builds: every CUDA branch of keel is compiled when the LibTorch has CUDA.
option(KEEL_CUDA "Build keel's CUDA/NCCL paths when the LibTorch has CUDA" ON)
set(KEEL_WITH_CUDA OFF)
if(KEEL_CUDA AND TARGET torch_cuda)
  set(KEEL_WITH_CUDA ON)
  target_compile_definitions(keel_deps INTERFACE KEEL_WITH_CUDA=1)
  # CUDA 13 keeps CCCL (thrust, cub, libcu++) under include/cccl; CMake < 3.31.9 does not add it.
  foreach(_inc ${CUDAToolkit_INCLUDE_DIRS})
    if(EXISTS "${_inc}/cccl")
      target_include_directories(keel_deps SYSTEM INTERFACE $<BUILD_INTERFACE:${_inc}/cccl>)
    endif()
  endforeach()
  # nccl.h must match the libnccl.so.2 that libtorch_cuda loads: the nvidia-nccl wheel torch pins
  # (its RUNPATH points there), never the system NCCL under /usr/local/cuda.
  find_path(KEEL_NCCL_INCLUDE_DIR nccl.h
    HINTS "${_keel_site}/nvidia/nccl/include" "${_keel_site}/nvidia/cu13/include" ${TORCH_INCLUDE_DIRS}
    NO_DEFAULT_PATH)
  if(NOT KEEL_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "keel: nccl.h matching LibTorch's NCCL not found next to ${Torch_DIR}; "
                        "set KEEL_NCCL_INCLUDE_DIR to the include/ folder of the NCCL libtorch_cuda loads, "
                        "or configure with -DKEEL_CUDA=OFF")
  endif()
  target_include_directories(keel_deps SYSTEM INTERFACE $<BUILD_INTERFACE:${KEEL_NCCL_INCLUDE_DIR}>)
  message(STATUS "keel: CUDA build (LibTorch ${Torch_VERSION}, nccl.h from ${KEEL_NCCL_INCLUDE_DIR})")
else()
  message(STATUS "keel: CPU build (LibTorch ${Torch_VERSION})")
endif()

# The Python that holds this LibTorch's torch package: tests, golden-file generators and
# benchmarks run it (and its torchrun) as the PyTorch reference.
if(_keel_site)
  get_filename_component(_keel_prefix "${_keel_site}/../../.." ABSOLUTE)
  set(_keel_python_default "${_keel_prefix}/bin/python")
else()
  set(_keel_python_default "")
endif()
set(KEEL_PYTHON "${_keel_python_default}" CACHE FILEPATH "Python with torch (the reference PyTorch and torchrun)")
if(KEEL_PYTHON)
  get_filename_component(_keel_bin "${KEEL_PYTHON}" DIRECTORY)
  set(KEEL_TORCHRUN "${_keel_bin}/torchrun" CACHE FILEPATH "torchrun of KEEL_PYTHON's torch")
endif()
