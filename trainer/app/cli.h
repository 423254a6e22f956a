// trainer/app/cli.h: the `keel` command line (CLI11).
//
//   keel train --config FILE [--section.key=value ...] [--print-config]
//   keel --version
//
// Every config key is an option generated from the config schema, so `keel train --help` lists
// each with its type, default and doc. Exit codes: 0 success, 2 bad usage or input (config,
// data, model files), 1 a failure while running, 128+N stopped by signal N.
#pragma once

#include <string>

namespace keel {

// run_cli, the command line's entry, is public: keel/trainer/trainer.h declares it.

/// "keel X.Y.Z (LibTorch A.B.C)"
std::string version_string();

}  // namespace keel
