// Summary -> summary.json. The field names are a contract (scripts read them); absent
// optionals are null, except tokens_per_s and the test_* fields, which are left out.
#include "keel/trainer/trainer.h"

namespace keel {
namespace {

template <class T>
nlohmann::json or_null(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

}  // namespace

nlohmann::json Summary::to_json() const {
  nlohmann::json j = {
      {"keel_version", keel_version},
      {"torch_version", torch_version},
      {"run_name", run_name},
      {"model", model},
      {"num_parameters", num_parameters},
      {"data", data},
      {"device", device},
      {"world_size", world_size},
      {"launcher", launcher},
      {"backend", backend},
      {"restart_count", restart_count},
      {"metrics_lines_lost", metrics_lines_lost},
      {"threads_per_rank", threads_per_rank},
      {"batch_size", batch_size},
      {"grad_accum", grad_accum},
      {"global_batch", global_batch},
      {"steps", steps},
      {"planned_steps", planned_steps},
      {"completed", completed},
      {"stop_signal", or_null(stop_signal)},
      {"median_step_ms", median_step_ms},
      {"samples_per_s", samples_per_s},
      {"final_loss", final_loss},
      {"wall_s", wall_s},
      {"compile_mode", compile_mode},
      {"compile_ms", compile_ms},
      {"compile_cache", compile_cache},
      {"recompiles", recompiles},
      {"amp_dtype", amp_dtype},
      {"consensus", consensus},
      {"loss_scale", or_null(loss_scale)},
      {"skipped_steps", skipped_steps},
      {"resumed_from_step", or_null(resumed_from_step)},
      {"checkpoint_step", or_null(checkpoint_step)},
      {"checkpoint_stall_ms", checkpoint_stall_ms},
  };
  j["rendezvous_ms"] = rendezvous_ms;
  j["eta_s"] = eta_s;
  j["mfu"] = or_null(mfu);
  j["peak_tflops"] = or_null(peak_tflops);
  j["zero"] = zero;
  j["optimizer_state_bytes"] = optimizer_state_bytes;
  j["peak_rss_mb"] = peak_rss_mb;
  j["control_per_step"] = {
      {"collectives", control_per_step.collectives}, {"validation_probes", control_per_step.probes},
      {"bytes_sent", control_per_step.bytes_sent},   {"bytes_received", control_per_step.bytes_received},
      {"wait_ms", control_per_step.wait_ms},         {"steps", control_per_step.steps}};
  if (tokens_per_s) j["tokens_per_s"] = *tokens_per_s;
  if (test_accuracy) j["test_accuracy"] = *test_accuracy;
  if (test_loss) j["test_loss"] = *test_loss;
  return j;
}

}  // namespace keel
