// The `keel` binary: a thin shell over the library (keel::run_cli, keel/trainer/trainer.h).
#include "keel/trainer/trainer.h"

int main(int argc, char** argv) { return keel::run_cli(argc, argv); }
