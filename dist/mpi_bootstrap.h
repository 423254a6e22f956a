// dist/mpi_bootstrap.h: under mpirun, rank 0 shares the TCPStore address through MPI itself,
// so that no MASTER_ADDR/MASTER_PORT is needed. MPI carries nothing else.
#pragma once

#include <string>

namespace keel::dist {

/// True when keel was built with MPI.
bool mpi_available();
/// Initialises MPI if needed; returns true if this call initialised it.
bool mpi_init();
/// Broadcasts `text` (at most 255 bytes) from rank 0; every rank returns rank 0's value.
std::string mpi_broadcast_string(const std::string& text);
void mpi_finalize();

}  // namespace keel::dist
