#include "trainer/checkpoints.h"

#include "common/file.h"
#include "common/log.h"
#include "keel/common/error.h"
#include "models/hf.h"
#include "trainer/compile/packaging.h"
#include "trainer/state.h"

namespace keel {

RunCheckpoints::RunCheckpoints(Run& run) : run_(run) {
  build();
  resume();
}

// Every component registers its own part of a checkpoint (checkpoint/stateful.h).
void RunCheckpoints::build() {
  if (run_.cfg.checkpoint.dir.empty()) return;
  auto own = [&](const char* name, std::unique_ptr<checkpoint::Stateful> c) {
    state_.add(name, *c);
    owned_state_.push_back(std::move(c));
  };
  own("model",
      run_.dmodel->model_state(
          run_.model, models::is_hf_family(run_.cfg.model.name) ? models::hf_shape(run_.cfg.model).config : nullptr));
  state_.add("optimizer", *run_.optimizer_state);
  state_.add("progress", run_.progress);
  if (run_.scaler) state_.add("grad_scaler", *run_.scaler);
  own("rng", std::make_unique<RngState>(run_.device));
  own("user", std::make_unique<UserState>(run_.cb.save_state, run_.cb.load_state));
  if (run_.cfg.checkpoint.save_graph && run_.cfg.compile.mode == CompileMode::Inductor)
    own("graph", std::make_unique<PackageState>(run_.dmodel->package_files(), run_.world.is_main()));
  else if (run_.cfg.checkpoint.save_graph)
    own("graph", std::make_unique<GraphState>([this] { return export_traced_module(run_.dmodel->model()); },
                                              run_.world.is_main()));
  state_.add("sampler", *run_.sampler);

  checkpoint::Options o;
  o.dir = run_.cfg.checkpoint.dir;
  o.keep = run_.cfg.checkpoint.keep;
  o.async = run_.cfg.checkpoint.async;
  o.config_sha256 = sha256_hex(dump_toml(run_.cfg));
  o.hooks = run_.faults->checkpoint_hooks();
  if (run_.optimizer_state->partitioned())  // each rank reads only its own parameters' state
    o.wants = [s = run_.optimizer_state.get()](const std::string& component, const std::string& n) {
      return component != "optimizer" || s->wants(n);
    };
  try {
    ckpt_ = std::make_unique<checkpoint::Checkpointer>(o, run_.coll);
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
        ckpt_->load(run_.cfg.checkpoint.resume_from, [this](const checkpoint::Loaded& l) { return state_.check(l); });
  } catch (const checkpoint::ResumeError& e) {
    throw InputError(e.what());  // the step the user named; a failed peer or disk stays exit 1
  }
  notified_step_ = ckpt_->last_committed();
  if (!loaded) {
    logging::info("checkpoint: no committed step under {}; starting fresh", run_.cfg.checkpoint.dir);
    return;
  }
  state_.load(*loaded);  // dist.zero = 3: each rank takes its pieces of the parameters read (ModelState)
  share_generators(run_.device, run_.mesh.on(dist::Axis::Tp));  // a tp group draws alike, whoever saved
  resumed_from_ = loaded->step;
  logging::info("resumed from {} (step {} of {})", loaded->path, loaded->step, run_.progress.total_steps);
}

bool RunCheckpoints::due(int64_t step) const {
  const int64_t every = run_.cfg.checkpoint.interval;
  return ckpt_ && every > 0 && step % every == 0 && step < run_.progress.total_steps;
}

void RunCheckpoints::commit() {
  ckpt_->commit();
  notify();
}

void RunCheckpoints::save(int64_t step) {
  run_.dmodel->sync_buffers();  // the buffers saved are rank 0's, whichever rank writes them
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
  if (run_.cb.on_checkpoint)
    run_.cb.on_checkpoint(notified_step_, run_.cfg.checkpoint.dir + "/step_" + std::to_string(notified_step_));
}

}  // namespace keel
