"""The RL loop: prompts → rollouts → rewards → advantages → update → metrics, checkpoints.

Step t (1-based) samples from the policy after t−1 updates; step 0 logs the held-out
evaluation of the starting policy. Everything that decides step t's numbers — params,
optimizer state, data-iterator state, advantage baseline, mismatch EMA, and the seeds (derived
from (seed, t)) — is in the checkpoint, so a resumed run repeats an uninterrupted one exactly.
"""
import contextlib
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from logra_jax import parallel, sketch
from logra_jax.bridge.client import FleetDown
from logra_jax.models.generator import JaxGenerator
from logra_jax.rl.advantages import get_advantage_fn
from logra_jax.rl.rewards import RewardScorer
from logra_jax.rl.types import GenerationRequest, SamplingParams
from logra_jax.train import host_memory, steps, summary, tasks, warm_start_cache
from logra_jax.train.checkpoint import Checkpointer, abstract_like
from logra_jax.train.fleet import FleetGenerator
from logra_jax.train.config import TrainConfig
from logra_jax.train.methods import get_method, prompt_group
from logra_jax.train.metrics import MetricWriter, read_metrics
from logra_jax.train.rollout import Rollouts, assemble_batch

TIMING_KEYS = ('step_time_s', 'tokens_per_s', 'generate_s', 'update_s', 'sync_s')
# Signals that stop a run after its current step, with a checkpoint (`stop_on_signals`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# rollout.engine -> a factory of the `logra_jax.rl.Generator`:
# f(cfg, workdir, model_config, params, version, pad_id). The config's
# CHOICES['rollout.engine'] lists the same names.
GENERATORS = {
    'embedded': lambda cfg, workdir, mc, params, version, pad_id: JaxGenerator(
        mc, params, version=version, pad_id=pad_id,
        own_params=cfg.rollout.max_staleness > 0),
    'http': FleetGenerator,
}


def generator_class(engine: str):
  """The rollout generator named by config key rollout.engine."""
  if engine not in GENERATORS:
    raise ValueError(f'config key rollout.engine={engine!r}: no such rollout engine in the '
                     f'loop; known: {sorted(GENERATORS)}')
  return GENERATORS[engine]


def check_fleet_processes(cfg: TrainConfig):
  """A fleet has one owner: with several processes each would pause and update the same
  servers (and `device_get` weights spanning other hosts), so that is refused at start."""
  n = jax.process_count()
  if cfg.rollout.engine == 'http' and n > 1:
    raise ValueError(
        f'config key rollout.engine=http with {n} processes: every process would pause and '
        'update the same servers (rollout.urls / rollout.launch). Run the fleet with one '
        'trainer process, or rollout.engine=embedded on several (its rollouts are gathered '
        'to every process)')


def _seed(cfg, t, salt):
  return int(np.random.SeedSequence([cfg.seed, t, salt]).generate_state(1)[0])


def _requests(task, records, cfg, t, n, temperature, salt=0, max_new_tokens=0):
  params = lambda i: SamplingParams(
      temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
      max_new_tokens=max_new_tokens or cfg.rollout.max_new_tokens,
      stop_token_ids=task.stop_ids, n=n, seed=_seed(cfg, t, salt * 1_000_000 + i))
  return [GenerationRequest(task.prompt_ids(r), params(i), request_id=str(i))
          for i, r in enumerate(records)]


def _score(task, scorer, results, records, n):
  texts = [task.decode(r.completion_token_ids) for r in results]
  refs = [task.reference(records[i // n]) for i in range(len(results))]
  return scorer.score(texts, refs)


def evaluate(task, generator, scorer, cfg: TrainConfig, t: int, answers=None) -> dict:
  """pass@1 (mean correctness of k samples per held-out problem), pass@k, and the share of
  held-out completions cut at the limit (eval.max_new_tokens, or rollout.max_new_tokens).
  ``answers``: a list that receives one dict per held-out completion, in order (problem
  index, completion text, reference, correct, finish_reason, tokens)."""
  k = cfg.eval.k
  results = generator.generate(_requests(task, task.eval_records, cfg, t, k,
                                         cfg.eval.temperature, salt=1,
                                         max_new_tokens=cfg.eval.max_new_tokens))
  correct = _score(task, scorer, results, task.eval_records, k).correct
  if answers is not None:
    answers.extend({'problem': i // k, 'completion': task.decode(r.completion_token_ids),
                    'reference': task.reference(task.eval_records[i // k]),
                    'correct': bool(c), 'finish_reason': r.finish_reason,
                    'tokens': len(r.completion_token_ids)}
                   for i, (r, c) in enumerate(zip(results, correct)))
  correct = correct.reshape(-1, k)
  return {'eval_accuracy': correct.mean(), 'eval_pass_at_k': correct.any(1).mean(),
          'eval_truncation_rate': np.mean([r.finish_reason == 'length' for r in results])}


def progress_postfix(metrics: dict, last_eval: dict) -> dict:
  """The progress bar's fields: this step's train accuracy and the LATEST held-out pass@1."""
  post = {'acc': f"{metrics['accuracy']:.2f}"}
  if last_eval:
    post['eval'] = f"{last_eval['eval_accuracy']:.2f}"
  return post


def rollout_metrics(results, scores, max_new_tokens) -> dict:
  lengths = np.array([len(r.completion_token_ids) for r in results])
  return {'reward_mean': scores.rewards.mean(), 'accuracy': scores.correct.mean(),
          'response_length': lengths.mean(),
          'truncation_rate': np.mean([r.finish_reason == 'length' for r in results]),
          'reward_timeouts': scores.timed_out}


def reward_scorer(cfg: TrainConfig) -> RewardScorer:
  r = cfg.reward
  return RewardScorer(r.verifier, correct=r.correct, incorrect=r.incorrect,
                      timeout_s=r.timeout_s, num_workers=r.workers)


def advantage_estimator(cfg: TrainConfig):
  return get_advantage_fn(cfg.rl.advantage, **(
      {'ema': cfg.rl.baseline_ema} if cfg.rl.advantage == 'running_baseline' else {}))


def reference_policy(cfg: TrainConfig, method, state):
  """A copy of the policy of ``state`` (the KL penalty's reference), or {} without one."""
  if not cfg.rl.kl_coef:
    return {}
  return jax.tree.map(jnp.copy, method.policy_params(state))


def checkpoint_like(method_state, estimator, ref) -> dict:
  """The structure a checkpoint's state is saved in (`Trainer.save`) and restored into."""
  return {'method': method_state, 'adv': estimator.init(), 'ref': ref}


class Trainer:
  """Owns the run: task, model, method, generator, scorer, checkpoints, metric writer."""

  def __init__(self, cfg: TrainConfig, workdir: str, log=print, layout=None):
    self.started = time.perf_counter()  # the summary's wall time: construction to the end
    check_fleet_processes(cfg)
    self.cfg, self.workdir, self.log = cfg, workdir, log
    self.layout = layout or parallel.layout_from_config(cfg.mesh)
    checkpoint = tasks.load_checkpoint(cfg)  # model.path's host copy (None: a preset)
    self.task = tasks.build_task(cfg, checkpoint=checkpoint)
    self.model, self.model_config, params = tasks.build_model(cfg, self.task, self.layout,
                                                              checkpoint)
    del checkpoint  # the params are on the devices now
    self.method = get_method(cfg, self.model, self.layout)
    self.estimator = advantage_estimator(cfg)
    generator = generator_class(cfg.rollout.engine)  # before a checkpoint or file is opened
    lg = cfg.optim.logra  # the budget sizes LoGRA's steps (the dense methods ignore it)
    self.budget = sketch.kl_budget_schedule(lg.kl_budget_init, lg.kl_budget_final,
                                            lg.kl_budget_steps)
    self.ckpt = Checkpointer(workdir, max_to_keep=cfg.keep_checkpoints or None)
    self.scorer = reward_scorer(cfg)
    self._ref_fns = {}
    self.step, resumed = self._restore_or_init(params)
    self.writer = MetricWriter(workdir, resume_step=self.step if resumed else -1)
    self.generator = generator(cfg, workdir, self.model_config,
                               self.method.policy_params(self.state), self.step, self.task.pad_id)
    self.rollouts = Rollouts(self.generator, self.task.train_iter, lambda records, t: _requests(
        self.task, records, cfg, t, cfg.data.samples_per_prompt, cfg.rollout.temperature),
                             cfg.rollout.max_staleness)
    self.rollouts.set_state(self._pending)
    self.resumed = resumed
    # A stop signal's number (set by `stop_on_signals`'s handler) and, once the loop stops for
    # it, its name: the run ends after the current step, with a checkpoint.
    self.stop_signal, self.stopped_by = None, None
    self.fleet_down = None  # the FleetDown a step's update met (`run` stops after that step)

  def _restore_or_init(self, params):
    latest = self.ckpt.latest_step()
    if latest is None:
      if self.cfg.warm_start.steps:
        params = warm_start_cache.warm_start(self.cfg, self.task, self.model, params,
                                             self.log)
      self.state = self.method.init(params)
      # The KL penalty's reference: the policy RL starts from (after any warm start).
      self.ref = self._reference()
      self.adv_state, self.mismatch, self._pending = self.estimator.init(), 0.0, []
      return 0, False
    self.state = self.method.init(params)
    self.ref = self._reference()
    restored, meta = self.ckpt.restore(latest, checkpoint_like(self.state, self.estimator,
                                                              self.ref))
    self.state, self.adv_state, self.ref = restored['method'], restored['adv'], restored['ref']
    self.mismatch, self._pending = meta['mismatch_ema'], meta.get('rollouts', [])
    self.task.train_iter.set_state(meta['data'])
    self.log(f'resumed from step {latest} in {self.ckpt.directory}')
    return latest, True

  def _reference(self):
    """A copy of the current policy (the step donates its params), or {} without a penalty."""
    return reference_policy(self.cfg, self.method, self.state)

  def save(self, data=None, pending=None):
    """The checkpoint of step self.step; ``data``/``pending``: the data-iterator state and
    the rollouts generated ahead, when not the live ones (`_stop_on_fleet_down`)."""
    meta = {'step': self.step, 'mismatch_ema': self.mismatch, 'seed': self.cfg.seed,
            'data': self.rollouts.data_state() if data is None else data}
    if self.cfg.rollout.max_staleness:
      meta['rollouts'] = self.rollouts.get_state() if pending is None else pending
    self.ckpt.save(self.step, {'method': self.state, 'adv': self.adv_state, 'ref': self.ref},
                   meta)
    host_memory.release()

  def _evaluate(self, t: int) -> dict:
    """The held-out evaluation at step t; what its sampler freed goes back (host_memory)."""
    out = evaluate(self.task, self.generator, self.scorer, self.cfg, t)
    host_memory.release()
    return out

  def collect(self, t: int):
    """Step t's training batch: rollouts, rewards, advantages (the estimator's state
    advances). Returns (batch, prompt_len, results, scores, staleness metrics, generation s)."""
    cfg, start = self.cfg, time.perf_counter()
    n = cfg.data.samples_per_prompt
    records, results, stale = self.rollouts.take(t)
    generate_s = time.perf_counter() - start
    scores = _score(self.task, self.scorer, results, records, n)
    rewards = parallel.same_on_every_process(np.asarray(scores.rewards, np.float32))
    adv, self.adv_state = self.estimator.update(rewards, self.adv_state, group_size=n)
    batch, p = assemble_batch(results, adv, cfg.rollout.max_new_tokens, self.task.pad_id,
                              self.task.prompt_len)
    return batch, p, results, scores, stale, generate_s

  def step_inputs(self, batch, prompt_len: int, t: int):
    """What step t's update takes besides the state: ``batch`` with the reference policy's
    log-probs when the loss has a KL-to-reference term, and the KL budget (its schedule at
    t, eased by the measured sampler mismatch)."""
    cfg = self.cfg
    if cfg.rl.kl_coef:
      if prompt_len not in self._ref_fns:
        self._ref_fns[prompt_len] = steps.make_ref_logp(
            self.model, prompt_len, cfg.rollout.temperature, self.method.ref_shardings,
            prompt_group(cfg))
      batch = dict(batch, ref_logp=parallel.to_host(
          self._ref_fns[prompt_len](self.ref, self.method.put_batch(batch))))
    return batch, float(sketch.effective_budget(self.budget(t - 1), self.mismatch))

  def train_step(self) -> dict:
    cfg, t = self.cfg, self.step + 1
    start = time.perf_counter()
    batch, p, results, scores, stale, generate_s = self.collect(t)
    host_memory.release()  # what the sampler freed, before the step allocates
    generated = start + generate_s
    batch, budget = self.step_inputs(batch, p, t)
    self.state, metrics = self.method.step(self.state, batch, p, t, budget)
    metrics = {k: float(v) for k, v in parallel.to_host(metrics).items()}
    ema = cfg.optim.logra.mismatch_ema
    self.mismatch = (1 - ema) * self.mismatch + ema * metrics['mismatch']
    self.step = t
    try:
      self.rollouts.wait()  # batches launched at this step were generated by version t - 1
      sync = self.generator.update_weights(self.method.policy_params(self.state), t,
                                           self.method.last_update())
    except FleetDown as e:  # step t is trained: `run` logs it, checkpoints it, then stops
      sync, self.fleet_down = {'fleet_servers_up': 0.0}, e
    end = time.perf_counter()
    metrics.update(sync or {}, **stale)
    tokens = float(batch['target_mask'].sum() + batch['mask'][:, :p].sum())
    metrics.update(rollout_metrics(results, scores, cfg.rollout.max_new_tokens),
                   step_time_s=end - start, generate_s=generated - start,
                   update_s=end - generated, tokens_per_s=tokens / (end - start),
                   weight_version=t)
    metrics.setdefault('predicted_kl', float('nan'))
    metrics.setdefault('alpha', float('nan'))
    metrics.setdefault('kl_budget', float('nan'))
    host_memory.release()
    return metrics

  def run(self, progress: bool = True):
    cfg, first = self.cfg, self.step
    last_eval = self._logged_eval()
    if self.step == 0:
      last_eval = self._evaluate(0)
      self.writer.write(0, last_eval)
    bar = tqdm(total=cfg.total_steps, initial=self.step, disable=not progress, desc='rl')
    while self.step < cfg.total_steps and not self._stop_requested():
      data = self.rollouts.data_state()  # a checkpoint of this step if the next one fails
      try:
        metrics = self.train_step()
      except FleetDown as e:  # no rollouts: the step was not taken
        self._stop_on_fleet_down(e, data)
      t = self.step
      if (t % cfg.eval_every == 0 or t == cfg.total_steps) and not self.fleet_down:
        try:
          last_eval = self._evaluate(t)
          metrics.update(last_eval)
        except FleetDown as e:  # step t is logged and checkpointed without its evaluation
          self.fleet_down = e
      self.writer.write(t, metrics)
      if self.fleet_down:
        self._stop_on_fleet_down(self.fleet_down, self.rollouts.data_state())
      if t % cfg.checkpoint_every == 0 or t == cfg.total_steps:
        self.save()
      bar.update(1)
      bar.set_postfix(progress_postfix(metrics, last_eval))
    bar.close()
    if self.stopped_by is not None:
      self._stop_with_checkpoint()
    self.log_summary(time.perf_counter() - self.started, self.step - first)

  def _stop_on_fleet_down(self, error: FleetDown, data):
    """No generation server is up: checkpoints the last finished step (data: the iterator
    state after it; rollouts generated ahead are dropped, generated again on resume), says
    so naming the servers, and raises ``error``."""
    if self.step and self.ckpt.latest_step() != self.step:
      self.save(data=data, pending=[])
    self.log(f'{error}: checkpointed step {self.step} in {self.ckpt.directory}; bring the '
             'servers back and rerun the same command to resume')
    raise error

  def _stop_requested(self) -> bool:
    """Whether a stop signal reached any process (all processes stop after the same step)."""
    if jax.process_count() > 1:
      got = parallel.to_host(np.asarray([self.stop_signal or 0], np.int32))
      self.stop_signal = int(np.max(got)) or None
    if self.stop_signal and self.step < self.cfg.total_steps:
      self.stopped_by = signal.Signals(self.stop_signal).name
    return self.stopped_by is not None

  def _stop_with_checkpoint(self):
    """After a stop signal: the checkpoint of the last finished step (unless written)."""
    if self.step and self.ckpt.latest_step() != self.step:
      self.save()
    self.log(f'{self.stopped_by}: stopped after step {self.step} of {self.cfg.total_steps}, '
             f'checkpoint in {self.ckpt.directory}; the same command resumes from it')

  def _logged_eval(self) -> dict:
    """The latest held-out evaluation in the metrics file (a resumed run's bar shows it)."""
    if not (self.writer.active and os.path.exists(self.writer.path)):
      return {}
    points = summary.eval_points(read_metrics(self.workdir))
    return {'eval_accuracy': points[-1][1]} if points else {}

  def log_summary(self, wall_s: float, steps_run: int):
    """The end-of-run summary (`logra_jax.train.summary`), from process 0's metrics file."""
    if not self.writer.active:
      return
    tb = os.path.join(self.workdir, 'tensorboard') if self.writer.tb is not None else None
    lines = summary.summary_lines(read_metrics(self.workdir), self.workdir, wall_s, steps_run,
                                  self.ckpt.directory, tb)
    self.log('\n'.join(lines))

  def close(self):
    self.rollouts.close()
    if hasattr(self.generator, 'close'):
      self.generator.close()
    self.writer.close()
    self.scorer.close()
    self.ckpt.close()


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer):
  """SIGTERM or SIGINT (a cluster's preemption, Ctrl-C) asks ``trainer`` to stop after the step
  in flight, checkpoint and return (`Trainer.stopped_by`); a second SIGINT stops at once
  (KeyboardInterrupt: the previous checkpoint stays the latest). Only in the main thread (where
  Python runs signal handlers); the previous handlers come back after."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def handler(signum, frame):
    del frame
    if signum == signal.SIGINT and trainer.stop_signal:
      raise KeyboardInterrupt
    trainer.stop_signal = trainer.stop_signal or signum
  previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def train(cfg: TrainConfig, workdir: str, progress: bool = True, log=print, layout=None):
  """Runs (or resumes) the run in ``workdir``; returns the `Trainer`. A stop signal ends it
  early with a checkpoint: then ``trainer.stopped_by`` names the signal (`stop_on_signals`)."""
  trainer = Trainer(cfg, workdir, log, layout)
  try:
    with stop_on_signals(trainer):
      trainer.run(progress)
  finally:
    trainer.close()
  return trainer


def checkpoint_steps(workdir: str, steps) -> list:
  """``steps`` of ``workdir``'s checkpoints (None: the latest), each checked to exist; an error
  names the steps the run has. Reads only (a folder without checkpoints/ stays as it was)."""
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):  # else the manager creates it
    raise ValueError(f'no checkpoints/ in {workdir}: not a run directory, or no step saved')
  ckpt = Checkpointer(workdir)  # it never saves here, so it deletes none
  try:
    have = ckpt.steps()
  finally:
    ckpt.close()
  out = [have[-1] if s is None and have else s for s in steps]
  for s in out:
    if s not in have:
      raise ValueError(f'no checkpoint of step {s} in {ckpt.directory} (it has {have})')
  return out


def checkpoint_policies(cfg: TrainConfig, workdir: str, layout=None):
  """(task, model, model_config, policy_at) to read ``workdir``'s checkpoints without writing
  there: the task and model are built once; ``policy_at(step)`` restores that checkpoint (a
  step `checkpoint_steps` returned) and returns its policy params."""
  task, model, model_config, method, state_at = checkpoint_states(cfg, workdir, layout)
  return task, model, model_config, lambda step: method.policy_params(state_at(step))


def checkpoint_states(cfg: TrainConfig, workdir: str, layout=None):
  """As `checkpoint_policies`, with the method and ``state_at(step)``: the method's whole
  restored state at that step (params, optimizer state, an adaptive subspace's A)."""
  layout = layout or parallel.layout_from_config(cfg.mesh)
  checkpoint = tasks.load_checkpoint(cfg)
  task = tasks.build_task(cfg, checkpoint=checkpoint)
  model, model_config, params = tasks.build_model(cfg, task, layout, checkpoint)
  del checkpoint
  method = get_method(cfg, model, layout)
  state = method.init(params)
  # Only the layout is kept: the initial state's arrays are freed once this returns.
  like = abstract_like(checkpoint_like(state, advantage_estimator(cfg),
                                       reference_policy(cfg, method, state)))

  def state_at(step: int):
    reader = Checkpointer(workdir)
    try:
      restored, _ = reader.restore(step, like)
    finally:
      reader.close()
    return restored['method']
  return task, model, model_config, method, state_at


def evaluate_checkpoint(cfg: TrainConfig, workdir: str, step=None, layout=None,
                        answers=None) -> dict:
  """The held-out evaluation of the policy in ``workdir``'s checkpoint of ``step`` (None: the
  latest), under ``cfg``'s eval section, read-only: nothing in ``workdir`` is written. With
  the run's own config it repeats the run's logged evaluation of that step (same params,
  same seeds); with another eval section (e.g. eval.max_new_tokens) it asks a new question
  of the same policy. Returns the evaluation's metrics, with 'step' and 'max_new_tokens';
  ``answers``: as `evaluate`'s."""
  if cfg.rollout.engine != 'embedded':
    raise ValueError('evaluate_checkpoint runs the embedded engine (config key rollout.engine='
                     f"'embedded'), got {cfg.rollout.engine!r}")
  step, = checkpoint_steps(workdir, [step])
  task, _, model_config, policy_at = checkpoint_policies(cfg, workdir, layout)
  generator = GENERATORS['embedded'](cfg, workdir, model_config, policy_at(step), step,
                                     task.pad_id)
  scorer = reward_scorer(cfg)
  try:
    out = evaluate(task, generator, scorer, cfg, step, answers)
  finally:
    scorer.close()
    if hasattr(generator, 'close'):
      generator.close()
  return {'step': int(step), 'max_new_tokens': cfg.eval.max_new_tokens or
          cfg.rollout.max_new_tokens, **{k: float(v) for k, v in out.items()}}
