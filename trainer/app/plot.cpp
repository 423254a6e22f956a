#include "trainer/app/plot.h"
#include "common/atomic_file.h"
#include "common/file.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "common/log.h"
#include "keel/trainer/config/config.h"
#include "trainer/metrics.h"

namespace keel {
namespace {

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

// A gnuplot single-quoted string: a quote inside is written twice.
std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

// A shell single-quoted word: a quote inside closes, escapes and reopens ('\'').
std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

double smoothing_weight(size_t points) {
  // About 1/40 of the run (at least 0.6, at most 0.99): visible trends, no step-to-step noise.
  if (points < 2) return 0.6;
  return std::clamp(1.0 - 40.0 / static_cast<double>(points), 0.6, 0.99);
}

std::string smoothed(const std::vector<std::pair<int64_t, double>>& points, double weight) {
  // TensorBoard's smoothing: an exponential moving average, debiased so that the first points
  // are not pulled toward 0. NaN losses (skipped steps) are left out of the average.
  std::ostringstream os;
  double ema = 0, norm = 0;
  for (const auto& [step, v] : points) {
    if (!std::isfinite(v)) continue;
    ema = weight * ema + (1 - weight) * v;
    norm = weight * norm + (1 - weight);
    os << step << '\t' << ema / norm << '\n';
  }
  return os.str();
}

namespace {

// metrics.jsonl as gnuplot's columns. Columns: step loss samples_per_s tokens_per_s loss_scale
// test_loss rank_compute_ms... Values that are not numbers (NaN is written as null) are gaps;
// each series counts its valid points, so that a panel is drawn from the series that have some
// (gnuplot stops the whole script at a plot none of whose points are valid).
struct RunSeries {
  std::ostringstream train, eval, ranks;
  std::vector<std::pair<int64_t, double>> losses;
  bool tokens = false, scale = false, has_eval = false;
  size_t nranks = 0, lines = 0;
  size_t valid_loss = 0, valid_samples = 0, valid_tokens = 0, valid_scale = 0, valid_eval = 0;
  std::vector<size_t> valid_rank;
  int64_t first_step = 0, last_step = 0;
};

void read_metrics(std::istream& in, const std::string& metrics, RunSeries& S) {
  size_t line_no = 0;
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      ++line_no;
      continue;  // a line cut by a crash
    }
    ++line_no;
    if (!j.is_object() || !j.contains("step") || !j.contains("loss")) continue;
    if (!j["step"].is_number_integer())
      throw InputError(metrics + ":" + std::to_string(line_no) + ": \"step\" is " + j["step"].dump() +
                       ", not an integer");
    const int64_t step = j["step"].get<int64_t>();
    S.first_step = S.lines == 0 ? step : std::min(S.first_step, step);
    S.last_step = S.lines == 0 ? step : std::max(S.last_step, step);
    ++S.lines;
    auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
    auto count = [](size_t& n, double v) { n += std::isfinite(v) ? 1 : 0; };
    S.tokens |= j.contains("tokens_per_s");
    S.scale |= j.contains("loss_scale");
    const double loss = num("loss"), samples = num("samples_per_s"), toks = num("tokens_per_s"),
                 loss_scale = num("loss_scale");
    count(S.valid_loss, loss);
    count(S.valid_samples, samples);
    count(S.valid_tokens, toks);
    S.valid_scale += std::isfinite(loss_scale) && loss_scale > 0 ? 1 : 0;  // on a log scale
    S.train << step << '\t' << loss << '\t' << samples << '\t' << toks << '\t' << loss_scale << '\n';
    S.losses.emplace_back(step, loss);
    if (j.contains("test_loss")) {
      S.has_eval = true;
      const double test_loss = num("test_loss");
      count(S.valid_eval, test_loss);
      S.eval << step << '\t' << test_loss << '\t' << num("test_accuracy") << '\n';
    }
    if (j.contains("rank_compute_ms") && j["rank_compute_ms"].is_array()) {
      S.nranks = std::max(S.nranks, j["rank_compute_ms"].size());
      S.valid_rank.resize(S.nranks, 0);
      S.ranks << step;
      size_t r = 0;
      for (const auto& v : j["rank_compute_ms"]) {
        const double ms = v.is_number() ? v.get<double>() : NAN;
        count(S.valid_rank[r++], ms);
        S.ranks << '\t' << ms;
      }
      S.ranks << '\n';
    }
  }
}

// The gnuplot script drawing the panels into `out`; their files are appended to `files`.
std::string gnuplot_script(const RunSeries& S, const std::string& run_dir, const std::string& out, double weight,
                           std::vector<std::string>& files) {
  std::ostringstream gp;
  gp << "set terminal pngcairo size 900,540 noenhanced\nset grid\nset key top right\nset xlabel 'step'\n";
  auto png = [&](const std::string& name, const std::string& title, const std::string& ylabel) {
    files.push_back(out + "/" + name);
    gp << "set output " << quote(out + "/" + name) << "\nset title " << quote(title) << "\nset ylabel " << quote(ylabel)
       << "\n";
  };
  // One panel: `plot` of the series with a valid point (`before`/`after` around it, e.g. a log
  // scale). A panel with none is still drawn, empty over the run's steps but for a note saying
  // so, and the note is logged: a run whose losses are all NaN plots, its gaps shown as gaps.
  struct Series {
    std::string spec;  // gnuplot's plot element
    size_t valid;      // points that are numbers
  };
  auto panel = [&](const std::string& name, const std::vector<Series>& series, const std::string& what,
                   const std::string& before = "", const std::string& after = "") {
    std::string specs;
    for (const auto& s : series)
      if (s.valid > 0) specs += (specs.empty() ? "" : ", ") + s.spec;
    if (!specs.empty()) {
      gp << before << "plot " << specs << "\n" << after;
      return;
    }
    const std::string note = "no " + what + " to plot: every value is missing or not a number (NaN)";
    logging::warn("keel plot: {}: {}", out + "/" + name, note);
    gp << "set xrange [" << S.first_step << ":" << (S.last_step > S.first_step ? S.last_step : S.first_step + 1)
       << "]\nset yrange [0:1]\nset label 1 " << quote(note) << " at graph 0.5, 0.5 center\nplot NaN notitle\n"
       << "unset label 1\nset autoscale x\nset autoscale y\n";
  };
  const std::string d = quote(out + "/train.dat");
  png("loss.png", "loss: " + run_dir, "loss");
  char smoothing[64];
  std::snprintf(smoothing, sizeof smoothing, "train loss, smoothed (EMA %.2f)", weight);
  std::vector<Series> loss_series = {
      {d + " using 1:2 with lines lc rgb '#b8cce4' lw 1 title 'train loss (each step)'", S.valid_loss},
      {quote(out + "/loss_smoothed.dat") + " using 1:2 with lines lc rgb '#1f4e9a' lw 2.5 title " + quote(smoothing),
       S.valid_loss}};
  if (S.has_eval)
    loss_series.push_back(
        {quote(out + "/eval.dat") + " using 1:2 with linespoints lc rgb '#d62728' pt 7 ps 1.2 lw 1.5 title 'test loss'",
         S.valid_eval});
  panel("loss.png", loss_series, "loss value");
  png("throughput.png", "throughput: " + run_dir, S.tokens ? "tokens/s" : "samples/s");
  panel(
      "throughput.png",
      {{d + " using 1:" + (S.tokens ? "4" : "3") + " with lines title '" + (S.tokens ? "tokens/s" : "samples/s") + "'",
        S.tokens ? S.valid_tokens : S.valid_samples}},
      S.tokens ? "tokens/s value" : "samples/s value");
  if (S.scale) {
    png("loss_scale.png", "loss scale: " + run_dir, "loss scale");
    panel("loss_scale.png", {{d + " using 1:5 with steps title 'loss scale'", S.valid_scale}}, "positive loss scale",
          "set logscale y 2\n", "unset logscale y\n");
  }
  if (S.nranks > 1) {
    png("rank_compute.png", "forward+backward per rank: " + run_dir, "ms");
    std::vector<Series> rank_series;
    for (size_t r = 0; r < S.nranks; ++r)
      rank_series.push_back({quote(out + "/ranks.dat") + " using 1:" + std::to_string(r + 2) +
                                 " with lines title 'rank " + std::to_string(r) + "'",
                             S.valid_rank[r]});
    panel("rank_compute.png", rank_series, "forward+backward time");
  }
  gp << "unset output\n";
  return gp.str();
}

}  // namespace

std::vector<std::string> plot_run(const std::string& run_dir, const std::string& out_dir_in) {
  const std::string metrics = run_dir + "/metrics.jsonl";
  if (const std::string what = not_a_regular_file(metrics); !what.empty())
    throw InputError(metrics + ": " + (what == "missing" ? "not found" : "is " + what) + " (is " + run_dir +
                     " a run directory?)");
  std::ifstream in(metrics);
  if (!in) throw InputError(metrics + ": cannot read (is " + run_dir + " a run directory?)");
  if (!have_gnuplot()) throw InputError("keel plot needs gnuplot (apt-get install gnuplot-nox; scripts/setup.sh does)");
  const std::string out = out_dir_in.empty() ? run_dir + "/plots" : out_dir_in;
  if (const std::string err = make_dirs(out); !err.empty()) throw InputError(err);

  RunSeries S;
  read_metrics(in, metrics, S);
  if (S.lines == 0) throw InputError(metrics + ": no step lines to plot");
  write_atomic(out + "/train.dat", S.train.str());
  // The per-step loss of a long run is a dense band: a smoothed curve goes over it.
  const double weight = smoothing_weight(S.losses.size());
  write_atomic(out + "/loss_smoothed.dat", smoothed(S.losses, weight));
  if (S.has_eval) write_atomic(out + "/eval.dat", S.eval.str());
  if (S.nranks > 1) write_atomic(out + "/ranks.dat", S.ranks.str());

  std::vector<std::string> files;
  const std::string script = out + "/plots.gp";
  write_atomic(script, gnuplot_script(S, run_dir, out, weight, files));
  const std::string cmd = "gnuplot " + shell_quote(script) + " 2>&1";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run gnuplot");
  std::string output;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) output += buf;
  const int rc = ::pclose(p);
  if (rc != 0) throw std::runtime_error("gnuplot failed on " + script + ": " + output.substr(0, 500));
  return files;
}

}  // namespace keel
