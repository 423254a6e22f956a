// Summary -> summary.json and docs/summary.md, both from KEEL_SUMMARY_FIELDS (keel/trainer/trainer.h),
// the one declaration of the summary's fields.
#include <sstream>
#include <type_traits>

#include "keel/trainer/trainer.h"

namespace keel {
namespace {

enum class Absent { null, omit };

template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};

nlohmann::json control_json(const ControlTraffic& c) {
  nlohmann::json j = nlohmann::json::object();
#define KEEL_PUT(type, name, init, absent, doc) j[#name] = c.name;
  KEEL_CONTROL_TRAFFIC_FIELDS(KEEL_PUT)
#undef KEEL_PUT
  return j;
}

template <class T>
void put(nlohmann::json& j, const char* key, const T& v, Absent absent) {
  if constexpr (IsOptional<T>::value) {
    if (v)
      j[key] = *v;
    else if (absent == Absent::null)
      j[key] = nullptr;
  } else if constexpr (std::is_same_v<T, ControlTraffic>) {
    j[key] = control_json(v);
  } else {
    j[key] = v;
  }
}

// The JSON type of a field as docs/summary.md names it.
template <class T>
std::string json_type(Absent absent) {
  if constexpr (IsOptional<T>::value)
    return json_type<typename T::value_type>(absent) + (absent == Absent::null ? " or null" : ", or absent");
  else if constexpr (std::is_same_v<T, std::string>)
    return "string";
  else if constexpr (std::is_same_v<T, bool>)
    return "boolean";
  else if constexpr (std::is_integral_v<T>)
    return "integer";
  else if constexpr (std::is_floating_point_v<T>)
    return "number";
  else
    return "object";
}

void row(std::ostream& os, const std::string& key, const std::string& type, const char* doc) {
  os << "| `" << key << "` | " << type << " | " << doc << " |\n";
}

}  // namespace

nlohmann::json Summary::to_json() const {
  nlohmann::json j = nlohmann::json::object();
#define KEEL_PUT(type, name, init, absent, doc) put(j, #name, name, Absent::absent);
  KEEL_SUMMARY_FIELDS(KEEL_PUT)
#undef KEEL_PUT
  return j;
}

std::string Summary::reference_markdown() {
  std::ostringstream os;
  os << "# summary.json\n\n"
        "Rank 0 writes `<run.dir>/summary.json` when a run ends, every planned step done or stopped by\n"
        "a signal; `keel::Trainer::run()` returns the same values as a `keel::Summary` on every rank.\n"
        "Optional values are `null` when absent, or left out where the type says so. The keys are a\n"
        "contract: scripts read them. Made by `keel summary-reference` from `KEEL_SUMMARY_FIELDS` in\n"
        "`include/keel/trainer/trainer.h`, the one declaration of the fields; a test keeps this file\n"
        "equal to it.\n\n"
        "| key | type | meaning |\n| --- | --- | --- |\n";
#define KEEL_ROW(type, name, init, absent, doc) row(os, #name, json_type<type>(Absent::absent), doc);
  KEEL_SUMMARY_FIELDS(KEEL_ROW)
#undef KEEL_ROW
#define KEEL_ROW(type, name, init, absent, doc) \
  row(os, std::string("control_per_step.") + #name, json_type<type>(Absent::absent), doc);
  KEEL_CONTROL_TRAFFIC_FIELDS(KEEL_ROW)
#undef KEEL_ROW
  return os.str();
}

}  // namespace keel
