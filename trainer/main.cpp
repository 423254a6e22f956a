// The `keel` binary: a thin shell over the library (see trainer/cli.h).
#include "trainer/cli.h"

int main(int argc, char** argv) { return keel::run_cli(argc, argv); }
