#include "trainer/checkpoints.h"

#include "common/file.h"
#include "common/log.h"
#include "keel/common/error.h"
#include "models/hf.h"
#include "trainer/compile/packaging.h"
#include "trainer/state.h"

namespace keel {

RunCheckpoints::RunCheckpoints(const JobParts& job, ModelParts& net, DataParts& data, UpdateParts& update,
                               Progress& progress)
    : job_(job), net_(net), data_(data), update_(update), progress_(progress) {
  build();
  resume();
}

// Every component registers its own part of a checkpoint (checkpoint/stateful.h).
void RunCheckpoints::build() {
  if (job_.cfg.checkpoint.dir.empty()) return;
  auto own = [&](const char* name, std::unique_ptr<checkpoint::Stateful> c) {
    state_.add(name, *c);
    owned_state_.push_back(std::move(c));
  };
  own("model",
      net_.dmodel->model_state(
          net_.model, models::is_hf_family(job_.cfg.model.name) ? models::hf_shape(job_.cfg.model).config : nullptr));
  state_.add("optimizer", *update_.optimizer_state);
  state_.add("progress", progress_);
  if (update_.scaler) state_.add("grad_scaler", *update_.scaler);
  own("rng", std::make_unique<RngState>(job_.device));
  own("user", std::make_unique<UserState>(job_.cb.save_state, job_.cb.load_state));
  if (job_.cfg.checkpoint.save_graph && job_.cfg.compile.mode == CompileMode::Inductor)
    own("graph", std::make_unique<PackageState>(net_.dmodel->package_files(), job_.world.is_main()));
  else if (job_.cfg.checkpoint.save_graph)
    own("graph", std::make_unique<GraphState>([this] { return export_traced_module(net_.dmodel->model()); },
                                              job_.world.is_main()));
  state_.add("sampler", *data_.sampler);

  checkpoint::Options o;
  o.dir = job_.cfg.checkpoint.dir;
  o.keep = job_.cfg.checkpoint.keep;
  o.async = job_.cfg.checkpoint.async;
  o.config_sha256 = sha256_hex(dump_toml(job_.cfg));
  o.hooks = job_.faults->checkpoint_hooks();
  if (update_.optimizer_state->partitioned())  // each rank reads only its own parameters' state
    o.wants = [s = update_.optimizer_state.get()](const std::string& component, const std::string& n) {
      return component != "optimizer" || s->wants(n);
    };
  try {
    ckpt_ = std::make_unique<checkpoint::Checkpointer>(o, job_.coll);
  } catch (const checkpoint::SaveError& e) {
    throw InputError(e.what());  // checkpoint.dir cannot be a directory: the user's choice of path
  }
}

// Resumes from the newest committed step (or checkpoint.resume_from).
void RunCheckpoints::resume() {
  if (!ckpt_) return;
  std::optional<checkpoint::Loaded> loaded;
  try {
    loaded =
        ckpt_->load(job_.cfg.checkpoint.resume_from, [this](const checkpoint::Loaded& l) { return state_.check(l); });
  } catch (const checkpoint::ResumeError& e) {
    throw InputError(e.what());  // the step the user named; a failed peer or disk stays exit 1
  }
  notified_step_ = ckpt_->last_committed();
  if (!loaded) {
    logging::info("checkpoint: no committed step under {}; starting fresh", job_.cfg.checkpoint.dir);
    return;
  }
  state_.load(*loaded);  // dist.zero = 3: each rank takes its pieces of the parameters read (ModelState)
  share_generators(job_.device, job_.mesh.on(dist::Axis::Tp));  // a tp group draws alike, whoever saved
  resumed_from_ = loaded->step;
  logging::info("resumed from {} (step {} of {})", loaded->path, loaded->step, progress_.total_steps);
}

bool RunCheckpoints::due(int64_t step) const {
  const int64_t every = job_.cfg.checkpoint.interval;
  return ckpt_ && every > 0 && step % every == 0 && step < progress_.total_steps;
}

void RunCheckpoints::commit() {
  ckpt_->commit();
  notify();
}

void RunCheckpoints::save(int64_t step) {
  net_.dmodel->sync_buffers();  // the buffers saved are rank 0's, whichever rank writes them
  // dist.zero = 3: the model stays sharded; each rank writes the whole parameters it owns
  // (ModelState, one unit gathered at a time) and their optimizer state (whole parameters', by
  // owner).
  ckpt_->save(step, state_.save());
  stall_ms_ += ckpt_->last_save_blocking_ms();
  notify();
}

void RunCheckpoints::finish(int64_t done) {
  if (!ckpt_) return;
  if (done > 0 && done != ckpt_->last_committed()) save(done);
  ckpt_->finish();
  notify();
}

// Callbacks::on_checkpoint, once per newly committed step.
void RunCheckpoints::notify() {
  if (!ckpt_ || ckpt_->last_committed() == notified_step_) return;
  notified_step_ = ckpt_->last_committed();
  if (job_.cb.on_checkpoint)
    job_.cb.on_checkpoint(notified_step_, job_.cfg.checkpoint.dir + "/step_" + std::to_string(notified_step_));
}

}  // namespace keel
