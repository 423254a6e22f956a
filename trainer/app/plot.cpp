#include "keel/common/atomic_file.h"
#include "keel/common/file.h"
#include "keel/trainer/app/plot.h"

#include "keel/common/file.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "keel/trainer/config/config.h"
#include "keel/trainer/metrics.h"

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

  // Columns: step loss samples_per_s tokens_per_s loss_scale test_loss rank_compute_ms...
  std::ostringstream train, eval, ranks;
  std::vector<std::pair<int64_t, double>> losses;
  bool tokens = false, scale = false, has_eval = false;
  size_t nranks = 0, lines = 0, line_no = 0;
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
    ++lines;
    auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
    tokens |= j.contains("tokens_per_s");
    scale |= j.contains("loss_scale");
    train << j["step"].get<int64_t>() << '\t' << num("loss") << '\t' << num("samples_per_s") << '\t'
          << num("tokens_per_s") << '\t' << num("loss_scale") << '\n';
    losses.emplace_back(j["step"].get<int64_t>(), num("loss"));
    if (j.contains("test_loss")) {
      has_eval = true;
      eval << j["step"].get<int64_t>() << '\t' << num("test_loss") << '\t' << num("test_accuracy") << '\n';
    }
    if (j.contains("rank_compute_ms") && j["rank_compute_ms"].is_array()) {
      nranks = std::max(nranks, j["rank_compute_ms"].size());
      ranks << j["step"].get<int64_t>();
      for (const auto& v : j["rank_compute_ms"]) ranks << '\t' << (v.is_number() ? v.get<double>() : NAN);
      ranks << '\n';
    }
  }
  if (lines == 0) throw InputError(metrics + ": no step lines to plot");
  write_atomic(out + "/train.dat", train.str());
  // The per-step loss of a long run is a dense band: a smoothed curve goes over it.
  const double weight = smoothing_weight(losses.size());
  write_atomic(out + "/loss_smoothed.dat", smoothed(losses, weight));
  if (has_eval) write_atomic(out + "/eval.dat", eval.str());
  if (nranks > 1) write_atomic(out + "/ranks.dat", ranks.str());

  std::vector<std::string> files;
  std::ostringstream gp;
  gp << "set terminal pngcairo size 900,540 noenhanced\nset grid\nset key top right\nset xlabel 'step'\n";
  auto png = [&](const std::string& name, const std::string& title, const std::string& ylabel) {
    files.push_back(out + "/" + name);
    gp << "set output " << quote(out + "/" + name) << "\nset title " << quote(title) << "\nset ylabel " << quote(ylabel)
       << "\n";
  };
  const std::string d = quote(out + "/train.dat");
  png("loss.png", "loss: " + run_dir, "loss");
  char smoothing[64];
  std::snprintf(smoothing, sizeof smoothing, "train loss, smoothed (EMA %.2f)", weight);
  gp << "plot " << d << " using 1:2 with lines lc rgb '#b8cce4' lw 1 title 'train loss (each step)', "
     << quote(out + "/loss_smoothed.dat") << " using 1:2 with lines lc rgb '#1f4e9a' lw 2.5 title " << quote(smoothing);
  if (has_eval)
    gp << ", " << quote(out + "/eval.dat")
       << " using 1:2 with linespoints lc rgb '#d62728' pt 7 ps 1.2 lw 1.5 title 'test loss'";
  gp << "\n";
  png("throughput.png", "throughput: " + run_dir, tokens ? "tokens/s" : "samples/s");
  gp << "plot " << d << " using 1:" << (tokens ? 4 : 3) << " with lines title '" << (tokens ? "tokens/s" : "samples/s")
     << "'\n";
  if (scale) {
    png("loss_scale.png", "loss scale: " + run_dir, "loss scale");
    gp << "set logscale y 2\nplot " << d << " using 1:5 with steps title 'loss scale'\nunset logscale y\n";
  }
  if (nranks > 1) {
    png("rank_compute.png", "forward+backward per rank: " + run_dir, "ms");
    gp << "plot ";
    for (size_t r = 0; r < nranks; ++r)
      gp << (r ? ", " : "") << quote(out + "/ranks.dat") << " using 1:" << r + 2 << " with lines title 'rank " << r << "'";
    gp << "\n";
  }
  gp << "unset output\n";
  const std::string script = out + "/plots.gp";
  write_atomic(script, gp.str());
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
