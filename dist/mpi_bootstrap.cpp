#include "dist/mpi_bootstrap.h"

#include <stdexcept>
#include <vector>

#ifdef KEEL_WITH_MPI
// The C API only: OpenMPI's deprecated C++ bindings need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace keel::dist {

#ifdef KEEL_WITH_MPI
namespace {
void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string("MPI: ") + what + " failed: " + std::string(msg, len));
  }
}
}  // namespace

bool mpi_available() { return true; }

bool mpi_init() {
  int inited = 0;
  check(MPI_Initialized(&inited), "MPI_Initialized");
  if (inited) return false;
  check(MPI_Init(nullptr, nullptr), "MPI_Init");
  return true;
}

std::string mpi_broadcast_string(const std::string& text) {
  std::vector<char> buf(256, '\0');
  if (text.size() >= buf.size()) throw std::runtime_error("MPI bootstrap: address too long: " + text);
  std::copy(text.begin(), text.end(), buf.begin());
  check(MPI_Bcast(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, 0, MPI_COMM_WORLD), "MPI_Bcast");
  return std::string(buf.data());
}

void mpi_finalize() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}
#else
bool mpi_available() { return false; }
bool mpi_init() { throw std::runtime_error("keel was built without MPI; launch with torchrun or srun"); }
std::string mpi_broadcast_string(const std::string&) { throw std::runtime_error("keel was built without MPI"); }
void mpi_finalize() {}
#endif

}  // namespace keel::dist
