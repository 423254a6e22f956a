// The `keel` binary: a thin shell over the library (see trainer/app/cli.h).
#include "keel/trainer/app/cli.h"

int main(int argc, char** argv) { return keel::run_cli(argc, argv); }
