// compile.cuda_graphs' orchestration (issue 46 item 4), rehearsed on the CPU
// (compile.cuda_graphs_rehearsal: a replay re-runs the captured function; the warm-up, the static
// input buffers and the copies into them, the captures, the learning rate and verdict read from
// static tensors, the outputs copied out, the counts and the address check are the code a GPU
// runs). A step that read anything but the static buffers, or a learning rate or verdict
// other than the step's, would train differently from the run without graphs: each run below
// ends with the run without graphs' losses, gradient norms, loss scales and checkpoint, to the
// last bit, at one rank (dropout, gradient accumulation, the dynamic loss scale and a skipped
// inf step inside the replays, AdamW and SGD), under DDP, ZeRO-2 and tensor parallelism, with a
// batch shape that changes, and resumed from a checkpoint.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "helpers.h"
#include "multirank.h"
#include "step_files.h"
#include "trainer/step/graphs.h"

using namespace keel::testing;

namespace {

const std::vector<std::string> kGpt = {"--model.name=gpt", "--model.width=32", "--model.depth=2", "--model.heads=4",
                                       "--model.context=16"};
const std::vector<std::string> kGraphs = {"--compile.cuda_graphs=true", "--compile.cuda_graphs_rehearsal=true",
                                          "--run.device=cpu"};

std::vector<std::string> graph_args(const std::string& dir, int steps, const std::vector<std::string>& extra,
                                    bool graphs) {
  std::vector<std::string> a = {"train",
                                "--data.name=synthetic",
                                "--train.steps=" + std::to_string(steps),
                                "--train.batch_size=8",
                                "--train.grad_clip=1",
                                "--train.eval_interval=" + std::to_string(steps),
                                "--dist.consensus=late",
                                "--run.threads=1",
                                "--run.dir=" + dir + "/run",
                                "--checkpoint.dir=" + dir + "/ckpt",
                                "--checkpoint.interval=" + std::to_string(steps)};
  a.insert(a.begin() + 1, kGpt.begin(), kGpt.end());
  a.insert(a.end(), extra.begin(), extra.end());
  if (graphs) a.insert(a.end(), kGraphs.begin(), kGraphs.end());
  return a;
}

std::string train(int ranks, const std::vector<std::string>& args, const std::string& label) {
  if (ranks == 1) {
    const auto r = run_keel(args);
    EXPECT_EQ(r.exit_code, 0) << label << ": " << r.output;
    return r.output;
  }
  const auto rs = run_keel_ranks(ranks, args);
  expect_all_ok(rs);
  return rs[0].output;
}

// The run with graphs and without, on `ranks` ranks, for `steps` steps: equal to the last bit;
// the graphs' counts as the warm-up and the batch shapes make them. Returns the graphed run's log.
std::string expect_bit_identical(int ranks, int steps, const std::vector<std::string>& extra, const std::string& label,
                                 int64_t captures, int64_t replays, bool scaled = false) {
  TempDir d;
  train(ranks, graph_args(d.file("eager"), steps, extra, false), label + ", without graphs");
  const std::string log = train(ranks, graph_args(d.file("graphs"), steps, extra, true), label + ", with graphs");
  EXPECT_NE(log.find("captured the forward and backward"), std::string::npos) << label << ": " << log;
  std::vector<std::string> fields = {"loss", "grad_norm"};
  if (scaled) fields.emplace_back("loss_scale");
  for (const auto& field : fields)
    EXPECT_EQ(metrics_losses(d.file("eager") + "/run", field), metrics_losses(d.file("graphs") + "/run", field))
        << label << ": " << field;
  for (const char* kind : {"model", "optimizer"})
    EXPECT_EQ(max_diff(d.file("eager"), d.file("graphs"), steps, kind), 0.0) << label << ": " << kind;
  EXPECT_EQ(summary_field(d.file("graphs") + "/run", "cuda_graph_captures"), std::to_string(captures)) << label;
  EXPECT_EQ(summary_field(d.file("graphs") + "/run", "cuda_graph_replays"), std::to_string(replays)) << label;
  EXPECT_EQ(summary_field(d.file("eager") + "/run", "cuda_graph_captures"), "null") << label;
  EXPECT_EQ(summary_field(d.file("eager") + "/run", "skipped_steps"),
            summary_field(d.file("graphs") + "/run", "skipped_steps"))
      << label;
  return log;
}

}  // namespace

// One rank: 3 warm-up steps, then the forward-backward and the update captured at step 4 and
// replayed for steps 4-10 (2 captures, 14 replays). The inf gradient injected at step 6 is skipped
// by the replayed update on the agreed verdict, and the loss scale backs off inside the graph.
TEST(CudaGraphs, TheRehearsalTrainsBitForBitAsWithoutAtOneRank) {
  const std::vector<std::string> scaled = {"--model.dropout=0.2", "--train.grad_accum=2", "--amp.loss_scaling=dynamic",
                                           "--amp.growth_interval=2", "--fault.inject=nonfinite_grad@step=6,rank=0"};
  expect_bit_identical(1, 10, scaled, "gpt, dropout, grad_accum 2, dynamic loss scale, an inf at step 6", 2, 14,
                       /*scaled=*/true);
  expect_bit_identical(1, 10, {"--train.optimizer=sgd", "--train.momentum=0.9", "--train.schedule=cosine"},
                       "gpt, fused SGD, a cosine schedule", 2, 14);
}

// Two ranks: with data parallelism 11 warm-up steps (PyTorch's for DDP), then steps 12-14 replayed
// (the Reducer's bucket all-reduces, ZeRO-2's reduce-scatter and parameter all-gather); at tp 2
// (no data parallelism) 3, then steps 4-14 (tensor parallelism's collectives); inside the graphs
// with their cross-rank check paused.
TEST(CudaGraphs, TheRehearsalTrainsBitForBitAsWithoutUnderDdpZero2AndTp2) {
  expect_bit_identical(2, 14, {"--model.dropout=0.2"}, "gpt, dropout, DDP", 2, 6);
  expect_bit_identical(2, 14, {"--dist.zero=2"}, "gpt, dist.zero = 2", 2, 6);
  expect_bit_identical(2, 14, {"--parallel.tp=2", "--parallel.sequence_parallel=true"}, "gpt, tp 2, sp", 2, 22);
}

// data.drop_last = false over 28 samples in batches of 8: shapes 8, 8, 8, 4 each epoch. Steps 1-3
// warm up (shape 8); step 4's shape 4 is new and runs one eager step (its collectives checked);
// the update is captured at step 4, shape 8's forward-backward at step 5, shape 4's at step 8 (a
// capture after the first: counted against compile.max_recompiles). 3 captures; 8 forward-backward
// and 9 update replays. With compile.max_recompiles = 0 that second capture is refused, exit 2.
TEST(CudaGraphs, ANewBatchShapeRunsOneEagerStepThenIsCapturedAgainstMaxRecompiles) {
  const std::vector<std::string> ragged = {"--data.synthetic_size=28", "--data.drop_last=false"};
  const std::string log = expect_bit_identical(1, 12, ragged, "gpt, batches of 8, 8, 8, 4", 3, 17);
  // The log names the step each capture was made at (dist.consensus = late: the loop's count of
  // steps done is one behind the step in hand).
  EXPECT_NE(log.find("step 5 captured the forward and backward of batch shape"), std::string::npos) << log;
  EXPECT_NE(log.find("step 8 captured the forward and backward of batch shape"), std::string::npos) << log;
  TempDir d;
  auto args = graph_args(d.path(), 12, ragged, true);
  args.push_back("--compile.max_recompiles=0");
  const auto r = run_keel(args);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("compile.max_recompiles = 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data.drop_last = true"), std::string::npos) << r.output;
}

// Killed at step 12 and resumed from step 10 with graphs (warm-up again: steps 11-13 eager, 14-15
// replayed), the run ends with the uninterrupted run without graphs' parameters and state.
TEST(CudaGraphs, AResumeWithGraphsEndsAsTheUninterruptedRunWithout) {
  TempDir d;
  const std::vector<std::string> extra = {"--model.dropout=0.2", "--checkpoint.interval=5"};
  train(1, graph_args(d.file("eager"), 15, extra, false), "without graphs");
  auto crashing = graph_args(d.file("graphs"), 15, extra, true);
  crashing.push_back("--fault.inject=crash@step=12,rank=0");
  EXPECT_TRUE(run_keel(crashing).signaled);
  train(1, graph_args(d.file("graphs"), 15, extra, true), "resumed with graphs");
  EXPECT_EQ(summary_field(d.file("graphs") + "/run", "resumed_from_step"), "10");
  EXPECT_EQ(summary_field(d.file("graphs") + "/run", "cuda_graph_replays"), "4");
  for (const char* kind : {"model", "optimizer"})
    EXPECT_EQ(max_diff(d.file("eager"), d.file("graphs"), 15, kind), 0.0) << kind;
}

// The address check: a parameter, or its gradient, that is no longer where the captured step
// writes is named.
TEST(CudaGraphs, TheAddressCheckNamesAParameterOrGradientThatMoved) {
  keel::TensorAddresses where;
  auto w = torch::zeros({4}, torch::requires_grad());
  w.mutable_grad() = torch::zeros({4});
  auto b = torch::zeros({2});
  where.record({{"w", w}, {"b", b}});
  EXPECT_EQ(where.first_moved({{"w", w}, {"b", b}}), "");
  w.mutable_grad().zero_();  // in place: still there
  EXPECT_EQ(where.first_moved({{"w", w}, {"b", b}}), "");
  w.mutable_grad() = torch::zeros({4});
  EXPECT_EQ(where.first_moved({{"w", w}, {"b", b}}), "w's gradient");
  where.record({{"w", w}, {"b", b}});
  b.set_data(torch::zeros({2}));
  EXPECT_EQ(where.first_moved({{"w", w}, {"b", b}}), "b");
  EXPECT_NE(where.first_moved({{"c", b}}).find("not there when the step was captured"), std::string::npos);
}
