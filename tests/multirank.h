// Multi-rank tests under ctest: run_ranks() re-executes this test binary once per rank
// (fork/exec, --gtest_filter = the current test, a free port chosen at run time) with
// torchrun's environment variables, and in each child runs `body` inside the same test, so
// EXPECT/ASSERT work there. In the parent it returns each rank's exit status and output.
//
//   TEST(Dist, Something) {
//     auto ranks = run_ranks(2, [](const keel::dist::World& w) { ...per-rank checks... });
//     if (is_rank_process()) return;
//     for (auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << r.output;
//   }
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "helpers.h"
#include "keel/dist/world.h"

namespace keel::testing {

bool is_rank_process();
std::vector<ProcResult> run_ranks(int n, const std::function<void(const keel::dist::World&)>& body,
                                  double timeout_s = 120, const std::vector<std::string>& extra_env = {});
/// Runs build/keel `args` as `n` ranks with torchrun's environment (a fresh port); returns each
/// rank's result, in rank order.
std::vector<ProcResult> run_keel_ranks(int n, const std::vector<std::string>& args, double timeout_s = 120,
                                       const std::vector<std::string>& extra_env = {});
/// The same for any program (argv[0], a binary linking keel: examples/custom_model).
std::vector<ProcResult> run_program_ranks(int n, const std::vector<std::string>& argv, double timeout_s = 120,
                                          const std::vector<std::string>& extra_env = {});
/// Asserts every rank exited 0 (prints each rank's output otherwise).
void expect_all_ok(const std::vector<ProcResult>& ranks);
/// Runs build/keel `args` on `ranks` ranks (1: one process, no launcher's environment) and expects
/// every rank to exit 0.
void run_keel_job(int ranks, const std::vector<std::string>& args);

}  // namespace keel::testing
