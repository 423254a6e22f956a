// trainer/app/log.h: logging setup. Every line carries a "[rank r/N]" prefix; rank 0 logs at
// run.log_level, the other ranks at warn unless run.all_ranks_log is set. Logs go to stderr
// so that stdout stays free for the progress line and for machine-readable output.
#pragma once

#include <cstdint>

#include "keel/trainer/config/config.h"

namespace keel {

void init_logging(const RunConfig& cfg, int64_t rank, int64_t world);

}  // namespace keel
