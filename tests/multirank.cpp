#include "multirank.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace keel::testing {

bool is_rank_process() { return std::getenv("KEEL_TEST_RANK") != nullptr; }

static std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

std::vector<ProcResult> run_ranks(int n, const std::function<void(const keel::dist::World&)>& body, double timeout_s,
                                  const std::vector<std::string>& extra_env) {
  if (is_rank_process()) {
    body(keel::dist::detect_world(keel::dist::current_env()));
    return {};
  }
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string(info->test_suite_name()) + "." + info->name();
  const int port = free_port();
  std::vector<Child> children;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env = {"KEEL_TEST_RANK=" + std::to_string(r),   "RANK=" + std::to_string(r),
                                    "WORLD_SIZE=" + std::to_string(n),       "LOCAL_RANK=" + std::to_string(r),
                                    "LOCAL_WORLD_SIZE=" + std::to_string(n), "MASTER_ADDR=127.0.0.1",
                                    "MASTER_PORT=" + std::to_string(port),   "OMP_NUM_THREADS=1"};
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    children.push_back(spawn_process({self_exe(), "--gtest_filter=" + filter}, env));
  }
  std::vector<ProcResult> out;
  for (auto& c : children) out.push_back(wait_process(c, timeout_s));
  return out;
}

void expect_all_ok(const std::vector<ProcResult>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_FALSE(ranks[r].timed_out) << "rank " << r << " timed out\n" << ranks[r].output;
    EXPECT_FALSE(ranks[r].signaled) << "rank " << r << " died by signal " << ranks[r].signal << "\n" << ranks[r].output;
    EXPECT_EQ(ranks[r].exit_code, 0) << "rank " << r << ":\n" << ranks[r].output;
  }
}

void run_keel_job(int ranks, const std::vector<std::string>& args) {
  if (ranks > 1) return expect_all_ok(run_keel_ranks(ranks, args));
  const auto r = run_keel(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

std::vector<ProcResult> run_keel_ranks(int n, const std::vector<std::string>& args, double timeout_s,
                                       const std::vector<std::string>& extra_env) {
  std::vector<std::string> argv = {KEEL_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_program_ranks(n, argv, timeout_s, extra_env);
}

std::vector<ProcResult> run_program_ranks(int n, const std::vector<std::string>& argv, double timeout_s,
                                          const std::vector<std::string>& extra_env) {
  const int port = free_port();
  std::vector<Child> kids;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env = {"RANK=" + std::to_string(r),       "WORLD_SIZE=" + std::to_string(n),
                                    "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(n),
                                    "MASTER_ADDR=127.0.0.1",           "MASTER_PORT=" + std::to_string(port)};
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    kids.push_back(spawn_process(argv, env));
  }
  std::vector<ProcResult> out;
  for (auto& k : kids) out.push_back(wait_process(k, timeout_s));
  return out;
}

}  // namespace keel::testing
