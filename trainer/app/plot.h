// trainer/app/plot.h: `keel plot RUN_DIR`, PNG curves of a run from its metrics.jsonl (gnuplot).
//
// Writes RUN_DIR/plots/loss.png (training loss per step, test loss at each evaluation),
// throughput.png (samples/s, and tokens/s for language models), loss_scale.png (with dynamic
// loss scaling) and rank_compute.png (each rank's forward+backward time, multi-rank runs).
// gnuplot (Debian's gnuplot-nox, installed by scripts/setup.sh) draws them.
#pragma once

#include <string>
#include <vector>

namespace keel {

/// Returns the PNG files written. Throws InputError when RUN_DIR has no metrics.jsonl or
/// gnuplot is missing, std::runtime_error when gnuplot fails.
std::vector<std::string> plot_run(const std::string& run_dir, const std::string& out_dir = "");

}  // namespace keel
