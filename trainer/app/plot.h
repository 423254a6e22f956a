// trainer/app/plot.h: `keel plot RUN_DIR`, PNG curves of a run from its metrics.jsonl (gnuplot).
//
// Writes RUN_DIR/plots/loss.png (training loss per step, faint, under a smoothed curve; test
// loss at each evaluation on top),
// throughput.png (samples/s, and tokens/s for language models), loss_scale.png (with dynamic
// loss scaling) and rank_compute.png (each rank's forward+backward time, multi-rank runs).
// gnuplot (Debian's gnuplot-nox, installed by scripts/setup.sh) draws them. Values that are
// not numbers (NaN, written as null) are gaps: a series with no number at all is left out of
// its panel, and a panel left with no series is still written, empty but for a note saying
// so (also logged as a warning), e.g. loss.png of a run whose losses are all NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace keel {

/// Returns the PNG files written. Throws InputError when RUN_DIR has no metrics.jsonl, it holds
/// no step line or gnuplot is missing, std::runtime_error when gnuplot fails.
std::vector<std::string> plot_run(const std::string& run_dir, const std::string& out_dir = "");

/// The smoothing weight for `points` loss values: about 1/40 of the run, within [0.6, 0.99].
double smoothing_weight(size_t points);
/// "step<TAB>value" lines of a debiased exponential moving average (TensorBoard's smoothing)
/// of (step, loss) points with `weight`; non-finite values are skipped.
std::string smoothed(const std::vector<std::pair<int64_t, double>>& points, double weight);

}  // namespace keel
