#include "dist/pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace keel::dist::pipeline {
namespace {

const char* op_name(Op op) {
  switch (op) {
    case Op::F:
      return "F";
    case Op::B:
      return "B";
    case Op::I:
      return "I";
    case Op::W:
      return "W";
    case Op::SendF:
      return "SEND_F";
    case Op::RecvF:
      return "RECV_F";
    case Op::SendB:
      return "SEND_B";
    case Op::RecvB:
      return "RECV_B";
  }
  return "?";
}

bool is_backward(Op op) { return op == Op::B || op == Op::I; }

using Key = std::tuple<int32_t, Op, int32_t>;
Key key(const Action& a) { return {a.stage, a.op, a.mb}; }

// Per-stage micro-batch counters: each call hands a stage its next micro-batch.
struct Counter {
  std::map<int, int> next;
  int operator()(int stage) { return next[stage]++; }
};

// GPipe: every forward of the rank's stage, then every backward, micro-batches in order.
std::vector<Action> gpipe(int rank, int M) {
  std::vector<Action> ops;
  for (int m = 0; m < M; ++m) ops.push_back({rank, Op::F, m});
  for (int m = 0; m < M; ++m) ops.push_back({rank, Op::B, m});
  return ops;
}

// 1F1B: P - 1 - rank warmup forwards, then a forward and a backward in turn, then the rest backward.
std::vector<Action> one_f_one_b(int rank, int P, int M) {
  std::vector<Action> ops;
  const int warmup = std::min(P - 1 - rank, M);
  int f = 0, b = 0;
  while (f < warmup) ops.push_back({rank, Op::F, f++});
  while (f < M) {
    ops.push_back({rank, Op::F, f++});
    ops.push_back({rank, Op::B, b++});
  }
  while (b < M) ops.push_back({rank, Op::B, b++});
  return ops;
}

// LoopedBFS: the rank's stages in order, each all its forwards; then in reverse, each all its
// backwards, micro-batches in reverse.
std::vector<Action> looped_bfs(int rank, int P, int M, int V) {
  std::vector<Action> ops;
  for (int k = 0; k < V; ++k)
    for (int m = 0; m < M; ++m) ops.push_back({k * P + rank, Op::F, m});
  for (int k = V - 1; k >= 0; --k)
    for (int m = M - 1; m >= 0; --m) ops.push_back({k * P + rank, Op::B, m});
  return ops;
}

// Interleaved 1F1B, and with `zero_bubble` InterleavedZeroBubble (I for B, then W: PyTorch's
// _get_1f1b_rank_ops, without its timing padding).
std::vector<Action> interleaved(int rank, int P, int M, int V, bool zero_bubble) {
  const int rounds = std::max(1, M / P), per_round = M / rounds;
  const int warmup = std::min((V - 1) * per_round + (zero_bubble ? 1 : 2) * (P - 1 - rank), M * V);
  const int total = M * V, fwd_bwd = total - warmup;
  const auto fstage = [&](int op) { return ((op / per_round) % V) * P + rank; };
  const auto bstage = [&](int op) { return (V - 1 - ((op - warmup) / per_round) % V) * P + rank; };
  Counter fmb, bmb, wmb;
  std::vector<Action> ops;
  std::vector<int> backward_ops;
  size_t weights = 0;
  const int first_w = zero_bubble ? rank : 0;  // num_1f1b_microbatches
  const auto weight = [&]() {
    const int s = bstage(backward_ops[weights++]);
    ops.push_back({s, Op::W, wmb(s)});
  };
  const Op back = zero_bubble ? Op::I : Op::B;
  for (int op = 0; op < warmup + fwd_bwd + warmup; ++op) {  // warmup, 1F1B, cooldown (as long as warmup)
    if (op < warmup) {
      ops.push_back({fstage(op), Op::F, fmb(fstage(op))});
      continue;
    }
    if (op < warmup + fwd_bwd) ops.push_back({fstage(op), Op::F, fmb(fstage(op))});
    ops.push_back({bstage(op), back, bmb(bstage(op))});
    backward_ops.push_back(op);
    if (zero_bubble && op - warmup >= first_w) weight();
  }
  while (zero_bubble && weights < backward_ops.size()) weight();
  return ops;
}

// ZBV (PyTorch's ScheduleZBVZeroBubble): two stages per rank in a V (rank r holds r and 2P-1-r),
// the backward split into input and weight gradients. Counted to max(2P - 1, M) micro-batches, the
// actions of micro-batches past M then dropped, as PyTorch does.
std::vector<Action> zbv(int rank, int P, int M) {
  const int n = std::max(2 * P - 1, M), c0 = rank, c1 = 2 * P - 1 - rank;
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  std::vector<Action> ops;
  const auto add = [&](int stage, Op op, int mb) { ops.push_back({stage, op, mb}); };
  for (int k = 0; k < 2 * (P - rank) - 1; ++k) add(c0, Op::F, f0++);
  for (int k = 0; k < rank; ++k) add(c1, Op::F, f1++), add(c0, Op::F, f0++);
  for (int k = 0; k < P - rank; ++k) add(c1, Op::F, f1++), add(c1, Op::I, b1), add(c1, Op::W, b1), ++b1;
  while (f1 < f0 || f0 < n) {
    if (f0 < n) add(c0, Op::F, f0++);
    add(c0, Op::I, b0), add(c0, Op::W, b0), ++b0;
    add(c1, Op::F, f1++), add(c1, Op::I, b1), add(c1, Op::W, b1), ++b1;
  }
  int w0 = b0, w1 = b1;
  for (int k = 0; k < rank; ++k) add(c0, Op::I, b0++), add(c1, Op::I, b1++);
  for (int k = 0; k < P - rank; ++k) add(c0, Op::I, b0++), add(c0, Op::W, w0++);
  while (w1 < b1) add(c1, Op::W, w1++);
  while (w0 < b0) add(c0, Op::W, w0++);
  ops.erase(std::remove_if(ops.begin(), ops.end(), [M](const Action& a) { return a.mb >= M; }), ops.end());
  return ops;
}

// DualPipeV (PyTorch's ScheduleDualPipeV, V-style stages): its overlapped forward-and-backward
// pairs (OVERLAP_F_B) as the forward then the full backward, the order PyTorch's runtime runs their
// sub-actions in; weight gradients from a FIFO of the input gradients deferred.
std::vector<Action> dualpipev(int rank, int P, int M) {
  const int c0 = rank, c1 = 2 * P - 1 - rank;
  std::map<std::pair<int, Op>, int> count;  // (stage, F | I | W) -> the next micro-batch
  std::deque<std::pair<int, int>> pending;  // (stage, mb) of input gradients awaiting their weights
  std::vector<Action> ops;
  const auto add = [&](int stage, Op op) {
    const int mb = count[{stage, op == Op::B ? Op::I : op}];
    ops.push_back({stage, op, mb});
    if (op == Op::B) {  // a full backward takes the input's and the weights' micro-batch
      ++count[{stage, Op::I}], ++count[{stage, Op::W}];
      return;
    }
    if (op == Op::I) pending.emplace_back(stage, mb);
    ++count[{stage, op}];
  };
  const auto weight = [&]() {
    if (pending.empty()) return;
    const auto [stage, mb] = pending.front();
    pending.pop_front();
    ops.push_back({stage, Op::W, mb});
    ++count[{stage, Op::W}];
  };
  const auto overlap = [&](int f, int b) { add(f, Op::F), add(b, Op::B); };
  for (int k = 0; k < (P - rank - 1) * 2; ++k) add(c0, Op::F);
  for (int k = 0; k < rank + 1; ++k) add(c0, Op::F), add(c1, Op::F);
  for (int k = 0; k < P - rank - 1; ++k) add(c1, Op::I), weight(), add(c1, Op::F);
  for (int i = 0; i < M - 2 * P + rank + 1; ++i) {
    overlap(c0, c1);  // the last rank's first pair is not overlapped in PyTorch: the same order
    overlap(c1, c0);
  }
  for (int k = 0; k < P - rank - 1; ++k) add(c1, Op::B), overlap(c1, c0);
  bool zb = false;
  for (int i = 0; i < rank + 1; ++i) {
    if (i == (rank + 1) / 2 && rank % 2 == 1) zb = true;
    add(c1, zb ? Op::I : Op::B);
    if (i == (rank + 1) / 2 && rank % 2 == 0) zb = true;
    add(c0, zb ? Op::I : Op::B);
  }
  for (int k = 0; k < P - rank - 1; ++k) weight(), add(c0, zb ? Op::I : Op::B);
  for (int k = 0; k < rank + 1; ++k) weight();
  return ops;
}

// PyTorch's _add_send_recv: the ranks walked in turn; a rank's next compute action is placed once
// what it reads is placed on that rank (its receive, or the adjacent stage there); a compute action
// whose result another rank reads is followed by its send, and its receive appended to that rank.
std::vector<std::vector<Action>> lower(const Schedule& s) {
  const int last = s.stages - 1;
  std::vector<std::deque<Action>> todo;
  for (const auto& r : s.compute) todo.emplace_back(r.begin(), r.end());
  std::vector<std::vector<Action>> out(static_cast<size_t>(s.pp));
  std::vector<std::set<Key>> placed(static_cast<size_t>(s.pp));
  const auto rank_of = [&](int stage) { return s.stage_rank.at(static_cast<size_t>(stage)); };
  const auto ready = [&](const Action& a, const std::set<Key>& prev) {
    if (a.op == Op::F && a.stage > 0)
      return prev.count({a.stage, Op::RecvF, a.mb}) || prev.count({a.stage - 1, Op::F, a.mb});
    if (is_backward(a.op) && a.stage < last)
      return prev.count({a.stage, Op::RecvB, a.mb}) || prev.count({a.stage + 1, Op::I, a.mb}) ||
             prev.count({a.stage + 1, Op::B, a.mb});
    return true;
  };
  for (bool left = true; left;) {
    left = false;
    bool progress = false;
    for (int r = 0; r < s.pp; ++r) {
      auto& q = todo[static_cast<size_t>(r)];
      if (q.empty()) continue;
      left = true;
      const Action a = q.front();
      if (!ready(a, placed[static_cast<size_t>(r)])) continue;
      out[static_cast<size_t>(r)].push_back(a);
      placed[static_cast<size_t>(r)].insert(key(a));
      const bool forward_out = a.op == Op::F && a.stage < last && rank_of(a.stage + 1) != r;
      const bool backward_out = is_backward(a.op) && a.stage > 0 && rank_of(a.stage - 1) != r;
      if (forward_out || backward_out) {
        const Action send{a.stage, forward_out ? Op::SendF : Op::SendB, a.mb};
        const Action recv{forward_out ? a.stage + 1 : a.stage - 1, forward_out ? Op::RecvF : Op::RecvB, a.mb};
        out[static_cast<size_t>(r)].push_back(send);
        placed[static_cast<size_t>(r)].insert(key(send));
        const auto peer = static_cast<size_t>(rank_of(recv.stage));
        out[peer].push_back(recv);
        placed[peer].insert(key(recv));
      }
      q.pop_front();
      progress = true;
    }
    if (left && !progress)
      throw std::logic_error("schedule " + s.name + ": its compute order cannot be given sends and receives (a rank " +
                             "waits for an input no rank produces before it)");
  }
  return out;
}

}  // namespace

std::string Action::str() const { return std::to_string(stage) + op_name(op) + std::to_string(mb); }

std::string Schedule::table() const {
  std::ostringstream o;
  o << name << ": pp " << pp << ", " << stages << " stages, " << microbatches << " micro-batches\n";
  for (size_t r = 0; r < lowered.size(); ++r) {
    o << "rank " << r << ":";
    for (const auto& a : lowered[r]) o << " " << a.str();
    o << "\n";
  }
  return o.str();
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe",          "1f1b", "interleaved", "looped-bfs",
                                                 "interleaved-zb", "zbv",  "dualpipev"};
  return names;
}

Schedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages) {
  if (std::find(schedule_names().begin(), schedule_names().end(), name) == schedule_names().end()) {
    std::string known;
    for (const auto& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown schedule \"" + name + "\" (known: " + known + ")");
  }
  if (pp < 1 || microbatches < 1 || virtual_stages < 1)
    throw std::invalid_argument("schedule " + name + ": pp, micro-batches and virtual stages must be >= 1");
  const bool single = name == "gpipe" || name == "1f1b";
  if (single && virtual_stages != 1)
    throw std::invalid_argument("schedule " + name + " runs one stage per rank, not " + std::to_string(virtual_stages));
  if (name == "1f1b" && microbatches < pp)
    throw std::invalid_argument("schedule 1f1b needs at least as many micro-batches as pp ranks: " +
                                std::to_string(microbatches) + " micro-batches for pp " + std::to_string(pp));
  const bool v_style = name == "zbv" || name == "dualpipev";
  if (v_style && virtual_stages != 2)
    throw std::invalid_argument("schedule " + name + " runs two stages per rank (a V), not " +
                                std::to_string(virtual_stages));
  if (name == "dualpipev" && microbatches < 2 * pp)
    throw std::invalid_argument("schedule dualpipev needs at least as many micro-batches as stages (2 x pp): " +
                                std::to_string(microbatches) + " micro-batches for pp " + std::to_string(pp));
  const bool interleaving = name == "interleaved" || name == "interleaved-zb";
  if (interleaving && microbatches % std::max(1, microbatches / pp) != 0)
    throw std::invalid_argument("schedule " + name + " splits the micro-batches into rounds of pp: " +
                                std::to_string(microbatches) + " micro-batches do not split into " +
                                std::to_string(std::max(1, microbatches / pp)) + " rounds at pp " + std::to_string(pp));
  Schedule s;
  s.name = name;
  s.pp = pp;
  s.stages = pp * virtual_stages;
  s.microbatches = microbatches;
  for (int stage = 0; stage < s.stages; ++stage)  // loop style; zbv's V: r and 2pp - 1 - r
    s.stage_rank.push_back(v_style && stage >= pp ? s.stages - 1 - stage : stage % pp);
  for (int r = 0; r < pp; ++r) {
    if (name == "gpipe")
      s.compute.push_back(gpipe(r, microbatches));
    else if (name == "1f1b")
      s.compute.push_back(one_f_one_b(r, pp, microbatches));
    else if (name == "zbv")
      s.compute.push_back(zbv(r, pp, microbatches));
    else if (name == "dualpipev")
      s.compute.push_back(dualpipev(r, pp, microbatches));
    else if (name == "looped-bfs")
      s.compute.push_back(looped_bfs(r, pp, microbatches, virtual_stages));
    else
      s.compute.push_back(interleaved(r, pp, microbatches, virtual_stages, name == "interleaved-zb"));
  }
  s.lowered = lower(s);
  return s;
}

void validate(const Schedule& s) {
  std::map<Key, int> count;
  std::set<Key> done;
  for (size_t r = 0; r < s.compute.size(); ++r) {
    for (const Action& a : s.compute[r]) {
      const std::string where = "schedule " + s.name + ", rank " + std::to_string(r) + ", " + a.str() + ": ";
      if (a.stage < 0 || a.stage >= s.stages || s.stage_rank.at(static_cast<size_t>(a.stage)) != static_cast<int>(r))
        throw std::logic_error(where + "the stage is not this rank's");
      if (a.mb < 0 || a.mb >= s.microbatches) throw std::logic_error(where + "no such micro-batch");
      if (++count[key(a)] > 1) throw std::logic_error(where + "twice");
      if (is_backward(a.op) && !done.count({a.stage, Op::F, a.mb}))
        throw std::logic_error(where + "the backward before its forward");
      if (a.op == Op::W && !done.count({a.stage, Op::I, a.mb}))
        throw std::logic_error(where + "a weight gradient before its input gradient");
      done.insert(key(a));
    }
  }
  for (int stage = 0; stage < s.stages; ++stage)
    for (int mb = 0; mb < s.microbatches; ++mb) {
      const std::string what =
          "schedule " + s.name + ": stage " + std::to_string(stage) + ", micro-batch " + std::to_string(mb) + ": ";
      if (!count[{stage, Op::F, mb}]) throw std::logic_error(what + "no forward");
      if (count[{stage, Op::B, mb}] + count[{stage, Op::I, mb}] != 1) throw std::logic_error(what + "no backward");
      if (count[{stage, Op::I, mb}] != count[{stage, Op::W, mb}])
        throw std::logic_error(what + "an input gradient without its weight gradient");
    }
}

namespace {

// The simulator's state: what each rank has done, and the messages in flight per (from, to) pair.
struct Sim {
  const Schedule& s;
  std::vector<std::set<Key>> done;
  std::map<std::pair<int, int>, std::deque<Action>> fifo;  // the sends, in order, as the peer will receive them
  std::vector<size_t> at;
  std::vector<int> in_flight, peak;

  // Why rank r cannot run `a` now ("" when it can).
  std::string waits(int r, const Action& a) const {
    const auto& d = done[static_cast<size_t>(r)];
    const int last = s.stages - 1;
    switch (a.op) {
      case Op::F:
        if (a.stage == 0 || d.count({a.stage, Op::RecvF, a.mb}) || d.count({a.stage - 1, Op::F, a.mb})) return "";
        return "its input";
      case Op::B:
      case Op::I:
        if (!d.count({a.stage, Op::F, a.mb})) return "its forward";
        if (a.stage == last || d.count({a.stage, Op::RecvB, a.mb}) || d.count({a.stage + 1, Op::B, a.mb}) ||
            d.count({a.stage + 1, Op::I, a.mb}))
          return "";
        return "its output's gradient";
      case Op::W:
        return d.count({a.stage, Op::I, a.mb}) ? "" : "its input gradient";
      case Op::SendF:
      case Op::SendB:
        return "";
      case Op::RecvF:
      case Op::RecvB: {
        const int from = s.stage_rank.at(static_cast<size_t>(a.op == Op::RecvF ? a.stage - 1 : a.stage + 1));
        const auto it = fifo.find({from, r});
        const Action want{a.op == Op::RecvF ? a.stage - 1 : a.stage + 1, a.op == Op::RecvF ? Op::SendF : Op::SendB,
                          a.mb};
        if (it != fifo.end() && !it->second.empty() && it->second.front() == want) return "";
        if (it != fifo.end() && !it->second.empty())
          return "rank " + std::to_string(from) + "'s " + want.str() + ", behind its " + it->second.front().str();
        return "rank " + std::to_string(from) + "'s " + want.str();
      }
    }
    return "?";
  }

  void run(int r, const Action& a) {
    if (a.op == Op::SendF || a.op == Op::SendB) {
      const int to = s.stage_rank.at(static_cast<size_t>(a.op == Op::SendF ? a.stage + 1 : a.stage - 1));
      fifo[{r, to}].push_back(a);
    } else if (a.op == Op::RecvF || a.op == Op::RecvB) {
      const int from = s.stage_rank.at(static_cast<size_t>(a.op == Op::RecvF ? a.stage - 1 : a.stage + 1));
      fifo[{from, r}].pop_front();
    } else if (a.op == Op::F) {
      peak[static_cast<size_t>(r)] = std::max(peak[static_cast<size_t>(r)], ++in_flight[static_cast<size_t>(r)]);
    } else if (is_backward(a.op)) {
      --in_flight[static_cast<size_t>(r)];
    }
  }
};

}  // namespace

SimResult simulate(const Schedule& s) {
  const auto P = static_cast<size_t>(s.pp);
  Sim sim{
      s, std::vector<std::set<Key>>(P), {}, std::vector<size_t>(P, 0), std::vector<int>(P, 0), std::vector<int>(P, 0)};
  SimResult out;
  long compute_ticks = 0;
  for (;;) {
    bool left = false;
    std::vector<std::pair<int, Action>> now;  // this tick's actions: their effects seen from the next tick
    for (size_t r = 0; r < P; ++r) {
      if (sim.at[r] >= s.lowered[r].size()) continue;
      left = true;
      const Action& a = s.lowered[r][sim.at[r]];
      if (sim.waits(static_cast<int>(r), a).empty()) now.emplace_back(static_cast<int>(r), a);
    }
    if (!left) break;
    if (now.empty()) {
      out.deadlock = true;
      for (size_t r = 0; r < P; ++r)
        if (sim.at[r] < s.lowered[r].size()) {
          const Action& a = s.lowered[r][sim.at[r]];
          out.blocked +=
              "rank " + std::to_string(r) + " at " + a.str() + " waits for " + sim.waits(static_cast<int>(r), a) + "; ";
        }
      break;
    }
    for (const auto& [r, a] : now) {
      sim.run(r, a);
      sim.done[static_cast<size_t>(r)].insert(key(a));
      ++sim.at[static_cast<size_t>(r)];
      compute_ticks += a.op == Op::F || a.op == Op::B || a.op == Op::I || a.op == Op::W;
    }
    ++out.ticks;
  }
  out.peak_in_flight = sim.peak;
  out.bubble = out.ticks > 0 ? 1.0 - static_cast<double>(compute_ticks) / (static_cast<double>(out.ticks) * s.pp) : 0;
  return out;
}

}  // namespace keel::dist::pipeline
