#include "trainer/app/doctor.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "keel/common/error.h"

namespace keel::doctor {
namespace {

using nlohmann::json;

// One numbering of operations (a group's calls, its replay lane, its messages, its buckets) as
// every rank recorded it: rank -> seq -> op.
struct Stream {
  std::string group, lane;
  std::vector<int64_t> members;
  std::map<int64_t, std::map<uint64_t, const json*>> ops;
};

// An operation in words: "world call #57: all_gather int64 [9] (per-step consensus)".
std::string op_text(const json& op) {
  std::ostringstream os;
  os << op.value("op", "?");
  if (!op.value("dtype", "").empty()) os << " " << op.value("dtype", "");
  if (const auto& shape = op["shape"]; !shape.empty()) {
    os << " [";
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i].get<int64_t>();
    os << "]";
  }
  if (op.contains("tag")) {
    os << (op.value("op", "") == "recv" ? " from " : " to ") << op.value("group", "") << " rank "
       << op.value("peer", int64_t{-1}) << " tag " << op["tag"].get<int64_t>();
  }
  if (!op.value("what", "").empty()) os << " (" << op.value("what", "") << ")";
  return os.str();
}

std::string place_text(const std::string& group, const std::string& lane, uint64_t seq) {
  static const std::map<std::string, std::string> words = {
      {"calls", "collective"}, {"replay", "replayed collective"}, {"p2p", "message"}, {"bucket", "gradient bucket"}};
  const auto it = words.find(lane);
  return group + " " + (it == words.end() ? lane : it->second) + " #" + std::to_string(seq);
}

std::string where_text(const json& op) {
  return op.value("where", op.value("phase", "?")) + ", step " + std::to_string(op.value("step", int64_t{0}));
}

std::string seconds(double ms) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << ms / 1000.0 << " s";
  return os.str();
}

bool same_call(const json& a, const json& b) {
  return a.value("op", "") == b.value("op", "") && a.value("dtype", "") == b.value("dtype", "") &&
         a["shape"] == b["shape"];
}

// A dump as the doctor reads it: the keys it walks present with their types (a record cut short or
// of another version gets empty ones, never an access out of bounds).
json normalized(const json& j) {
  json out = j.is_object() ? j : json::object();
  for (const char* key : {"ops", "events", "log_tail"})
    if (!out.contains(key) || !out[key].is_array()) out[key] = json::array();
  json ops = json::array();
  for (const json& op : out["ops"]) {
    if (!op.is_object()) continue;
    json o = op;
    if (!o.contains("shape") || !o["shape"].is_array()) o["shape"] = json::array();
    ops.push_back(std::move(o));
  }
  out["ops"] = std::move(ops);
  if (out.contains("groups") && !out["groups"].is_object()) out.erase("groups");
  return out;
}

// The ranks' dumps, one per rank (the newest), and the groups they name.
struct Dumps {
  int64_t world = 0;
  std::map<int64_t, const json*> by_rank;
  std::map<std::string, std::vector<int64_t>> groups;
};

Dumps index(const std::vector<json>& dumps) {
  Dumps d;
  for (const json& j : dumps) {
    const int64_t r = j.value("rank", int64_t{-1});
    if (r < 0) continue;
    d.world = std::max(d.world, j.value("world_size", int64_t{1}));
    auto& slot = d.by_rank[r];
    if (!slot || j.value("dumped_ms", 0.0) > slot->value("dumped_ms", 0.0)) slot = &j;
  }
  for (const auto& [r, j] : d.by_rank)
    if (j->contains("groups"))
      for (const auto& [name, ranks] : (*j)["groups"].items()) {
        auto& members = d.groups[name];
        for (const auto& x : ranks)
          if (std::find(members.begin(), members.end(), x.get<int64_t>()) == members.end())
            members.push_back(x.get<int64_t>());
        std::sort(members.begin(), members.end());
      }
  if (d.groups["world"].empty())
    for (int64_t r = 0; r < d.world; ++r) d.groups["world"].push_back(r);
  return d;
}

std::map<std::pair<std::string, std::string>, Stream> streams_of(const Dumps& d) {
  std::map<std::pair<std::string, std::string>, Stream> streams;
  for (const auto& [r, j] : d.by_rank)
    for (const json& op : (*j)["ops"]) {
      const std::string g = op.value("group", ""), lane = op.value("lane", "");
      Stream& s = streams[{g, lane}];
      s.group = g;
      s.lane = lane;
      s.ops[r][op.value("seq", uint64_t{0})] = &op;
    }
  for (auto& [key, s] : streams) {
    const auto it = d.groups.find(s.group);
    if (it != d.groups.end()) s.members = it->second;
    for (const auto& [r, ops] : s.ops)
      if (std::find(s.members.begin(), s.members.end(), r) == s.members.end()) s.members.push_back(r);
    std::sort(s.members.begin(), s.members.end());
  }
  return streams;
}

// Where a stream diverged: the first sequence number some rank did not complete, with each
// member's entry there (null: none).
struct Divergence {
  const Stream* stream = nullptr;
  uint64_t seq = 0;
  double first_ms = 0;  // the earliest enqueue among the ranks that entered it
  std::map<int64_t, const json*> entry;
};

std::optional<Divergence> divergence_of(const Stream& s) {
  if (s.lane == "p2p") return std::nullopt;  // numbered per rank: matched by pair and tag instead
  std::optional<uint64_t> at;
  for (const auto& [r, ops] : s.ops) {
    uint64_t f = ops.rbegin()->first + 1;
    for (const auto& [seq, op] : ops)
      if (op->value("state", "") != "completed") {
        f = seq;
        break;
      }
    at = at ? std::min(*at, f) : f;
  }
  if (!at) return std::nullopt;
  Divergence v;
  v.stream = &s;
  v.seq = *at;
  bool open = false, missing = false, present = false;
  v.first_ms = INFINITY;
  for (const int64_t r : s.members) {
    const auto rank_ops = s.ops.find(r);
    const json* e = nullptr;
    if (rank_ops != s.ops.end()) {
      const auto it = rank_ops->second.find(*at);
      if (it != rank_ops->second.end()) e = it->second;
    }
    v.entry[r] = e;
    if (e) {
      present = true;
      open |= e->value("state", "") != "completed";
      v.first_ms = std::min(v.first_ms, e->value("enqueue_ms", 0.0));
    } else {
      missing = true;
    }
  }
  if (!present || (!open && !missing)) return std::nullopt;
  return v;
}

// Point-to-point: each message that did not complete on a rank, with its peer's matching one
// (the other end, the same tag and step) or none; the divergence is the earliest such message.
// Each one's pair of ranks is kept in `pairs` (the Divergence points at it).
std::optional<Divergence> p2p_divergence(const Dumps& d, std::deque<Stream>& pairs) {
  std::optional<Divergence> first;
  for (const auto& [r, dump] : d.by_rank)
    for (const json& op : (*dump)["ops"]) {
      if (op.value("lane", "") != "p2p" || op.value("state", "") == "completed") continue;
      const std::string group = op.value("group", "");
      const auto members = d.groups.find(group);
      const int64_t local = op.value("peer", int64_t{-1});
      if (members == d.groups.end() || local < 0 || local >= static_cast<int64_t>(members->second.size())) continue;
      const int64_t peer = members->second[static_cast<size_t>(local)];
      const double t = op.value("enqueue_ms", 0.0);
      if (first && first->first_ms <= t) continue;
      const json* other = nullptr;
      if (d.by_rank.count(peer)) {
        const std::string want = op.value("op", "") == "send" ? "recv" : "send";
        for (const json& o : (*d.by_rank.at(peer))["ops"])
          if (o.value("lane", "") == "p2p" && o.value("group", "") == group && o.value("op", "") == want &&
              o.value("tag", int64_t{-1}) == op.value("tag", int64_t{-2}) && o.value("step", 0) == op.value("step", 0))
            other = &o;
      }
      // A send is waited for at the schedule's end: its receiver's completed receive says it arrived.
      if (other && other->value("state", "") == "completed") continue;
      // Both ends posted and neither waited yet (a receive posted ahead, a send not waited for):
      // not where a rank was blocked.
      // (On NCCL, "enqueued": both ends handed to the device, whose result has not come yet.)
      const auto posted = [](const json& o) {
        const std::string st = o.value("state", "");
        return st == "issued" || st == "enqueued";
      };
      if (other && posted(op) && posted(*other)) continue;
      Stream& s = pairs.emplace_back();
      s.group = group;
      s.lane = "p2p";
      s.members = {std::min(r, peer), std::max(r, peer)};
      Divergence v;
      v.stream = &s;
      v.seq = op.value("seq", uint64_t{0});
      v.first_ms = t;
      v.entry[r] = &op;
      v.entry[peer] = other;
      first = v;
    }
  return first;
}

std::string rank_status(const Divergence& v, int64_t r, const Dumps& d, json& row) {
  const json* e = v.entry.at(r);
  row["rank"] = r;
  if (!d.by_rank.count(r)) {
    row["status"] = "no record";
    std::string seen;  // the call before, which its peers completed with it
    for (const auto& [peer, ops] : v.stream->ops)
      if (const auto it = ops.find(v.seq - 1); v.seq > 0 && it != ops.end() && seen.empty()) {
        seen = "; last seen completing " + place_text(v.stream->group, v.stream->lane, v.seq - 1) + ", " +
               op_text(*it->second) + " in " + where_text(*it->second);
        row["last_seen"] = *it->second;
      }
    return "left no flight record (dead: killed, crashed, out of memory, or its host lost)" + seen;
  }
  if (!e) {
    row["status"] = "never entered";
    const json& dump = *d.by_rank.at(r);
    row["where"] = dump.value("where", "?");
    row["step"] = dump.value("step", int64_t{0});
    return "never entered it; it was in " + dump.value("where", std::string("?")) + " at step " +
           std::to_string(dump.value("step", int64_t{0}));
  }
  const std::string state = e->value("state", "");
  row["status"] = state == "issued" ? "stuck" : state;
  row["op"] = op_text(*e);
  row["where"] = e->value("where", "");
  row["step"] = e->value("step", int64_t{0});
  row["entered_ms"] = e->value("enqueue_ms", 0.0);
  const double late = e->value("enqueue_ms", 0.0) - v.first_ms;
  std::string text = (state == "issued"      ? std::string("entered it and is stuck")
                      : state == "completed" ? std::string("completed it")
                      : state == "enqueued"  ? std::string("enqueued it; the device has not finished it")
                                             : "entered it: " + state) +
                     (late >= 500 ? " (entered " + seconds(late) + " after the first)" : "") + "; " + op_text(*e) +
                     " in " + where_text(*e);
  if (e->contains("end_ms") && state != "completed")
    text += ", after " + seconds((*e)["end_ms"].get<double>() - e->value("start_ms", 0.0));
  return text;
}

// The latest operation of rank r's record (any group), or null.
const json* last_op(const json& dump) {
  const json* last = nullptr;
  for (const json& op : dump["ops"])
    if (!last || op.value("enqueue_ms", 0.0) >= last->value("enqueue_ms", 0.0)) last = &op;
  return last;
}

// "0, 2, 3".
std::string rank_list(const std::vector<int64_t>& rs) {
  std::string out;
  for (size_t i = 0; i < rs.size(); ++i) out += (i ? ", " : "") + std::to_string(rs[i]);
  return out;
}

// Whether every event of a rank's record is a SIGUSR1 request (a snapshot of a live run).
bool snapshot_only(const json& dump) {
  for (const json& ev : dump["events"])
    if (ev.value("reason", "").rfind("SIGUSR1", 0) != 0) return false;
  return true;
}

// Records written while the run went on (SIGUSR1, no failure in any) whose divergent operation
// is open (issued, or enqueued on the device) on the ranks that entered it, the oldest for
// `open_for` ms, under dist.timeout_s (`live`): a snapshot of work in flight, maybe a hang to be.
struct Snapshot {
  bool live = false;
  double open_for = 0, timeout = 0;
};
Snapshot snapshot_of(const Divergence& v, const Dumps& d) {
  Snapshot s;
  bool open = false;
  for (const auto& [r, e] : v.entry) {
    if (!d.by_rank.count(r)) return {};
    const json& dump = *d.by_rank.at(r);
    if (!snapshot_only(dump) || !dump.contains("timeout_ms")) return {};
    s.timeout = dump.value("timeout_ms", 0.0);
    const std::string state = e ? e->value("state", "") : "";
    if (!e || state == "completed") continue;  // (a peer's result came sooner)
    if (state != "issued" && state != "enqueued") return {};
    open = true;
    s.open_for = std::max(s.open_for, dump.value("dumped_ms", 0.0) - e->value("start_ms", 0.0));
  }
  s.live = open && s.open_for < s.timeout;
  return s;
}

// A snapshot whose operation every rank entered, or one that a rank has not reached for less than
// kNotThereYetMs: in flight, not a hang. Null otherwise (then the cause found says how long).
constexpr double kNotThereYetMs = 5000;
std::optional<json> in_flight(const Snapshot& snap, const std::string& place, const std::vector<int64_t>& never) {
  if (!snap.live || (!never.empty() && snap.open_for >= kNotThereYetMs)) return std::nullopt;
  const std::string waiting = rank_list(never);
  return json{{"kind", "in_flight"},
              {"ranks", json::array()},
              {"open_for_ms", snap.open_for},
              {"text", place + " was in flight when the records were written (asked for with SIGUSR1; open for " +
                           seconds(snap.open_for) + ", under dist.timeout_s = " + seconds(snap.timeout) + ")" +
                           (waiting.empty() ? "" : ", rank(s) " + waiting + " not there yet") +
                           ": a live run, not (yet) a hang. Ask again to see whether it moves"}};
}

// Ranks that died: no record, or (while a peer's record says the run failed) only a SIGUSR1
// snapshot from before their peers entered the divergence, and none since. Null: none.
std::optional<json> dead_cause(const Divergence& v, const Dumps& d, const std::string& place,
                               const std::vector<int64_t>& dead, const std::vector<int64_t>& never,
                               const std::vector<int64_t>& entered) {
  // A rank whose only record is a SIGUSR1 snapshot from before its peers entered the divergence,
  // while a peer's record says the run failed: it wrote nothing since, so it died after it.
  std::vector<int64_t> silent;
  if (std::any_of(d.by_rank.begin(), d.by_rank.end(), [](const auto& rd) { return !snapshot_only(*rd.second); }))
    for (const int64_t r : never)
      if (const json& dump = *d.by_rank.at(r); snapshot_only(dump) && dump.value("dumped_ms", 0.0) < v.first_ms)
        silent.push_back(r);
  if (dead.empty() && silent.empty()) return std::nullopt;
  std::vector<int64_t> all = dead;
  all.insert(all.end(), silent.begin(), silent.end());
  std::sort(all.begin(), all.end());
  return json{
      {"kind", "dead_rank"},
      {"ranks", all},
      {"text",
       "rank(s) " + rank_list(all) + " died: " +
           (dead.empty() ? std::string()
                         : "no flight record from " + rank_list(dead) + (silent.empty() ? std::string("") : "; ")) +
           (silent.empty() ? std::string()
                           : "only a SIGUSR1 snapshot from " + rank_list(silent) +
                                 ", written before the others entered it, and none since") +
           " (a SIGKILL, a crash, the out-of-memory killer or a lost host); the others waited for them in " + place +
           (entered.empty() ? "" : " (" + where_text(*v.entry.at(entered.front())) + ")")}};
}

json cause_at(const Divergence& v, const Dumps& d, const Snapshot& snap) {
  const Stream& s = *v.stream;
  const std::string place = place_text(s.group, s.lane, v.seq);
  std::vector<int64_t> dead, never, entered;
  for (const auto& [r, e] : v.entry) (!d.by_rank.count(r) ? dead : e ? entered : never).push_back(r);
  // The ranks issued different calls there: the paths they took differ.
  for (size_t i = 0; i < entered.size(); ++i)
    for (size_t k = i + 1; k < entered.size(); ++k) {
      const json &a = *v.entry.at(entered[i]), &b = *v.entry.at(entered[k]);
      if (s.lane == "p2p" ? a.value("dtype", "") == b.value("dtype", "") && a["shape"] == b["shape"]
                          : same_call(a, b) && a.value("phase", "") == b.value("phase", ""))
        continue;
      const bool eval = (a.value("phase", "") == "eval") != (b.value("phase", "") == "eval");
      const bool shape_only =
          s.lane == "p2p" || (a.value("op", "") == b.value("op", "") && a.value("phase", "") == b.value("phase", ""));
      const std::string both = "rank " + std::to_string(entered[i]) + " issued " + op_text(a) + " in " + where_text(a) +
                               ", rank " + std::to_string(entered[k]) + " issued " + op_text(b) + " in " +
                               where_text(b);
      if (shape_only)
        return {{"kind", "shape_mismatch"},
                {"ranks", {entered[i], entered[k]}},
                {"text", "the ranks disagree on the shape of " + place + ": " + both +
                             ". The same call has another tensor on one rank (a batch, a model or a split built "
                             "differently there)"}};
      const int64_t odd = a.value("phase", "") == "eval" ? entered[i] : entered[k];
      return {{"kind", eval ? "extra_evaluation" : "different_paths"},
              {"ranks", {entered[i], entered[k]}},
              {"text", "the ranks took different paths at " + place + ": " + both +
                           (eval ? ". Rank " + std::to_string(odd) +
                                       " was still evaluating: an extra evaluation batch (its test shard holds more "
                                       "batches than its peers')"
                                 : ". A rank skipped or added a collective (a block's backward that did not run, a "
                                   "branch on data that differs between ranks)")}};
    }
  if (auto died = dead_cause(v, d, place, dead, never, entered)) return *died;
  if (const auto snapshot = in_flight(snap, place, never)) return *snapshot;
  if (!never.empty()) {
    const int64_t r = never.front();
    const json& dump = *d.by_rank.at(r);
    // A rank that went on waits in another operation of its own (one still open, begun after its
    // peers entered this one); a rank with none open stopped in its own code.
    const json* mine = nullptr;
    // (A receive posted ahead and never waited for is not where it waits.)
    for (const json& o : dump["ops"])
      if (o.value("state", "") != "completed" && o.value("enqueue_ms", 0.0) > v.first_ms &&
          !(o.value("lane", "") == "p2p" && o.value("state", "") == "issued"))
        mine = &o;
    const bool went_on = mine != nullptr;
    const std::string where =
        dump.value("where", std::string("?")) + " at step " + std::to_string(dump.value("step", int64_t{0}));
    if (went_on)
      return {{"kind", "skipped"},
              {"ranks", never},
              {"text", "rank(s) " + rank_list(never) + " skipped " + place + " and went on to " + op_text(*mine) +
                           " in " + where_text(*mine) +
                           ": a collective its peers made and it did not (a block's backward it skipped, a branch "
                           "on data that differs between ranks)"}};
    return {{"kind", "hang"},
            {"ranks", never},
            {"text", "rank(s) " + rank_list(never) + " never issued " + place + " that rank(s) " + rank_list(entered) +
                         " waited in: rank " + std::to_string(r) + " stopped in " + where +
                         " (hung: a deadlock, an endless loop, a blocked read, or slower than dist.timeout_s)"}};
  }
  int64_t latest = -1;
  double spread = 0;
  for (const int64_t r : entered) {
    const double late = v.entry.at(r)->value("enqueue_ms", 0.0) - v.first_ms;
    if (late > spread) spread = late, latest = r;
  }
  if (latest >= 0 && spread >= 1000)
    return {{"kind", "straggler"},
            {"ranks", {latest}},
            {"text", "rank " + std::to_string(latest) + " reached " + place + " " + seconds(spread) +
                         " after its peers (a straggler: its peers gave up at dist.timeout_s; it was in " +
                         where_text(*v.entry.at(latest)) + ")"}};
  return {{"kind", "network"},
          {"ranks", entered},
          {"text", "every rank entered " + place +
                       " and none completed it: the network or the backend (a lost connection, a partition)"}};
}

// The cause at the divergence; from SIGUSR1 snapshots of an operation open under dist.timeout_s,
// with how long it has been open (it may still move).
json cause_of(const Divergence& v, const Dumps& d) {
  const Snapshot snap = snapshot_of(v, d);
  json cause = cause_at(v, d, snap);
  const bool dead = cause.value("kind", "") == "dead_rank";
  if (!dead && snap.live && cause.value("kind", "") != "in_flight") {
    cause["open_for_ms"] = snap.open_for;
    cause["text"] = cause.value("text", "") + ". The records are SIGUSR1 snapshots and it has been open for " +
                    seconds(snap.open_for) + ", under dist.timeout_s = " + seconds(snap.timeout) +
                    ": ask again to see whether it moves";
  }
  return cause;
}

void describe_ranks(const Dumps& d, json& out, std::ostringstream& text) {
  text << "ranks:\n";
  for (int64_t r = 0; r < d.world; ++r) {
    json row = {{"rank", r}, {"record", d.by_rank.count(r) > 0}};
    if (!d.by_rank.count(r)) {
      text << "  rank " << r << ": no flight record\n";
      out.push_back(row);
      continue;
    }
    const json& dump = *d.by_rank.at(r);
    row["host"] = dump.value("host", "");
    row["where"] = dump.value("where", "");
    row["step"] = dump.value("step", int64_t{0});
    std::string reason;
    if (!dump["events"].empty()) {
      const json& ev = dump["events"].back();
      reason = ev.value("reason", "");
      const std::string error = ev.value("error", "");
      if (!error.empty()) reason += ": " + error.substr(0, std::min<size_t>(error.find('\n'), 300));
    }
    row["dumped_for"] = reason;
    text << "  rank " << r << " (" << dump.value("host", std::string("?")) << ", pid " << dump.value("pid", 0)
         << "): " << dump.value("where", std::string("?")) << " at step " << dump.value("step", int64_t{0})
         << "; dumped for: " << reason << "\n";
    if (const json* last = last_op(dump)) {
      row["last_op"] = *last;
      text << "    last: "
           << place_text(last->value("group", ""), last->value("lane", ""), last->value("seq", uint64_t{0})) << " "
           << op_text(*last) << ", " << last->value("state", "") << "\n";
    }
    if (dump.contains("log_tail") && !dump["log_tail"].empty()) {
      row["log_last_line"] = dump["log_tail"].back();
      text << "    log: " << dump["log_tail"].back().get<std::string>().substr(0, 300) << "\n";
    }
    out.push_back(row);
  }
}

}  // namespace

Report diagnose(const std::vector<json>& read) {
  std::vector<json> dumps;
  for (const json& j : read) dumps.push_back(normalized(j));
  const Dumps d = index(dumps);
  const auto streams = streams_of(d);
  std::deque<Stream> pairs;
  std::optional<Divergence> first = p2p_divergence(d, pairs);
  // The Reducer's raw calls come last: its used-parameter map spans a whole backward, so it is
  // entered before any bucket the ranks diverged at.
  for (const bool raw : {false, true})
    for (const auto& [key, s] : streams)
      if (auto v = (s.lane == "raw") == raw && !(raw && first) ? divergence_of(s) : std::nullopt;
          v && (!first || v->first_ms < first->first_ms))
        first = v;
  Report rep;
  std::ostringstream text;
  std::vector<int64_t> have;
  for (const auto& [r, j] : d.by_rank) have.push_back(r);
  rep.json["world_size"] = d.world;
  rep.json["records"] = have;
  text << "keel doctor: " << d.world << " rank(s), flight records from " << have.size() << "\n";
  if (!first) {
    rep.json["divergence"] = nullptr;
    rep.json["cause"] = {{"kind", "none"},
                         {"text",
                          "no divergence: every rank's record agrees (the run is healthy, or every rank "
                          "stopped at the same place)"}};
    text << "likely cause: " << rep.json["cause"]["text"].get<std::string>() << "\n";
  } else {
    const Stream& s = *first->stream;
    json div = {{"group", s.group}, {"lane", s.lane}, {"seq", first->seq}, {"ranks", json::array()}};
    text << "first divergence: " << place_text(s.group, s.lane, first->seq) << "\n";
    for (const auto& [r, e] : first->entry) {
      json row;
      text << "  rank " << r << ": " << rank_status(*first, r, d, row) << "\n";
      div["ranks"].push_back(row);
    }
    rep.json["divergence"] = div;
    rep.json["cause"] = cause_of(*first, d);
    text << "likely cause (" << rep.json["cause"]["kind"].get<std::string>()
         << "): " << rep.json["cause"]["text"].get<std::string>() << "\n";
  }
  rep.json["ranks"] = json::array();
  describe_ranks(d, rep.json["ranks"], text);
  rep.text = text.str();
  return rep;
}

Report diagnose_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InputError("keel doctor: " + dir + " is not a directory");
  static const std::regex name(R"(rank\d+\.json)");
  std::vector<json> dumps;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (it->is_directory() && it->path().filename() == "previous") {
      it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file() || !std::regex_match(it->path().filename().string(), name)) continue;
    std::ifstream in(it->path());
    try {
      dumps.push_back(json::parse(in));
    } catch (const std::exception& e) {
      throw InputError("keel doctor: " + it->path().string() + " is not a flight record: " + e.what());
    }
  }
  if (dumps.empty())
    throw InputError("keel doctor: no flight record (flight/rank<R>.json) under " + dir +
                     " (dist.flight_recorder = 0, or no rank has failed, been signalled or stalled)");
  return diagnose(dumps);
}

}  // namespace keel::doctor
