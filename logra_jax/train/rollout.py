"""The embedded JAX generator (the default `Generator`), the loop's rollout schedule
(`Rollouts`: on-policy, or generated up to `rollout.max_staleness` steps ahead) and rollout →
training-batch assembly.

Shape key: N completions, P prompt length (left padded), T = max_new_tokens, L = P + T.
"""
import concurrent.futures
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import parallel
from logra_jax.models.config import ModelConfig
from logra_jax.models.sampler import SamplingParams as EngineSampling
from logra_jax.models.sampler import (bucket_size, decode_copy, generate_arrays, pad_prompts,
                                      prompt_length, stop_array)
from logra_jax.rl.types import GenerationRequest, GenerationResult


class JaxGenerator:
  """Samples with the in-process KV-cache sampler; satisfies `logra_jax.rl.Generator`.

  All requests of one call share max_new_tokens, sampling settings and stop ids (one compiled
  program per shape bucket). The longest prompt plus max_new_tokens must fit the model's
  context (ValueError before generation). Per-completion seeds come from the request's seed,
  so a completion does not depend on the rest of the batch.
  """

  def __init__(self, config: ModelConfig, params, version: int = 0, pad_id: int = 0,
               own_params: bool = False):
    self.config, self._version, self.pad_id = config, version, pad_id
    if own_params and jax.process_count() > 1:
      raise ValueError('config key rollout.max_staleness > 0 with rollout.engine=embedded '
                       'generates in a thread, which a multi-process run cannot (every '
                       'process must run its collectives in one order): use rollout.engine='
                       'http, or rollout.max_staleness=0')
    self.own_params = own_params
    self.params = self._own(params)

  def _own(self, params):
    """A copy when generation overlaps the trainer's step (which donates its params)."""
    return jax.tree.map(jnp.copy, params) if self.own_params else params

  @property
  def weight_version(self) -> int:
    return self._version

  def update_weights(self, params, version: int, update=None):
    """The policy after step ``version`` (in process: the arrays themselves)."""
    del update
    self.params, self._version = self._own(params), version

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    if not requests:
      return []
    sp = requests[0].params
    if any(r.params.max_new_tokens != sp.max_new_tokens or r.params.temperature != sp.temperature
           or r.params.top_p != sp.top_p or r.params.top_k != sp.top_k
           or r.params.stop_token_ids != sp.stop_token_ids for r in requests):
      raise ValueError('JaxGenerator needs the same sampling settings (max_new_tokens, '
                       'temperature, top_p, top_k, stop_token_ids) for all requests of a call')
    # Every request asks n samples: each prompt is prefilled once and its cache forked.
    n_each = requests[0].params.n if len({r.params.n for r in requests}) == 1 else 1
    prompts, seeds, owners = [], [], []
    for i, r in enumerate(requests):
      base = r.params.seed if r.params.seed is not None else i
      prompts += [r.prompt_token_ids] * (r.params.n // n_each)
      for j in range(r.params.n):
        seeds.append((base * 1_000_003 + j) % (1 << 32))
        owners.append((r, j))
    u = bucket_size(len(prompts), 1)
    p = prompt_length(self.config, max(map(len, prompts)), sp.max_new_tokens)
    tokens, mask = pad_prompts(prompts, u, p, self.pad_id)
    seeds_b = np.zeros((u * n_each,), np.uint32)
    seeds_b[:len(seeds)] = seeds
    out = generate_arrays(self.params, decode_copy(self.config, self.params), tokens, mask,
                          seeds_b, stop_array(sp.stop_token_ids), config=self.config,
                          max_new_tokens=sp.max_new_tokens,
                          sampling=EngineSampling(sp.temperature, sp.top_p, sp.top_k),
                          samples=n_each)
    toks, logps, lens, stopped = parallel.to_host(out)  # every process gets every row
    return [GenerationResult(
        request_id=r.request_id, sample_index=j, prompt_token_ids=r.prompt_token_ids,
        completion_token_ids=toks[i, :lens[i]], behaviour_logprobs=logps[i, :lens[i]],
        finish_reason='stop' if stopped[i] else 'length', weight_version=self._version)
        for i, (r, j) in enumerate(owners)]


def assemble_batch(results: Sequence[GenerationResult], advantages, max_new_tokens: int,
                   pad_id: int = 0, prompt_len: int = 0):
  """Training arrays from completions: prompt left-padded to P, completion right-padded to T.

  Returns:
    (batch dict of numpy arrays, P). ``prompt_len`` (if larger) fixes P to avoid recompiles.
  """
  n, t = len(results), max_new_tokens
  p = max(prompt_len, bucket_size(max(len(r.prompt_token_ids) for r in results), 8))
  tokens = np.full((n, p + t), pad_id, np.int32)
  mask = np.zeros((n, p + t), bool)
  targets = np.full((n, t), pad_id, np.int32)
  tmask = np.zeros((n, t), np.float32)
  blogp = np.zeros((n, t), np.float32)
  for i, r in enumerate(results):
    pr, co = r.prompt_token_ids, r.completion_token_ids
    tokens[i, p - len(pr):p], mask[i, p - len(pr):p] = pr, True
    tokens[i, p:p + len(co)], mask[i, p:p + len(co)] = co, True
    targets[i, :len(co)], tmask[i, :len(co)] = co, 1.0
    blogp[i, :len(co)] = r.behaviour_logprobs
  batch = dict(tokens=tokens, mask=mask, targets=targets, target_mask=tmask,
               behaviour_logp=blogp, advantages=np.asarray(advantages, np.float32))
  return batch, p


def check_prompt_groups(batch, prompt_len: int, group: int):
  """Raises ValueError unless every run of ``group`` rows holds one prompt (tokens and mask
  of the first ``prompt_len`` positions): what prompt sharing (`StepConfig.prompt_group`)
  relies on. `assemble_batch` of a step's results (a prompt's samples contiguous) passes."""
  tokens, mask = batch['tokens'][:, :prompt_len], batch['mask'][:, :prompt_len]
  n = tokens.shape[0]
  if n % group:
    raise ValueError(f'{n} rows do not split into prompt groups of {group}')
  first = np.repeat(np.arange(0, n, group), group)
  bad = np.flatnonzero(np.any((tokens != tokens[first]) | (mask != mask[first]), axis=1))
  if bad.size:
    i = int(bad[0])
    raise ValueError(f'row {i} of the batch does not hold the prompt of row {first[i]}, the '
                     f'first of its group of {group}: prompt sharing needs each prompt\'s '
                     'samples in contiguous rows (set optim.share_prompts=False otherwise)')


# --- the rollout schedule -----------------------------------------------------------------


def staleness_metrics(results: Sequence[GenerationResult], version: int) -> dict:
  """How many updates behind the trainer's weights (``version``) each sample was generated."""
  ages = np.array([version - r.weight_version for r in results], np.float64)
  return {'staleness_max': float(ages.max()), 'staleness_mean': float(ages.mean())}


class Rollouts:
  """The batches the loop trains on: step t's records and completions.

  ``max_staleness`` s = 0: step t's batch is generated at step t by the weights after t−1
  updates (on-policy). s > 0: `take(t)` also launches the batches of steps up to t+s (one
  thread, in step order) on the weights of version t−1, and `wait` (called before step t's
  update is sent) lets them finish, so generation overlaps the update and batch t+s is
  generated by version t−1 exactly: deterministic, and trained on at step t+s by version
  t+s−1 (staleness s; less for the first s steps). Every sample keeps the behaviour
  log-probs and the version it was generated with (the loss's TIS ratio corrects them); a
  batch holding a sample more than s versions old is never used: it is regenerated now.
  Records are drawn in step order, so the data are those of the on-policy run.
  """

  def __init__(self, generator, data_iter, requests: Callable, max_staleness: int = 0):
    self.generator, self.data_iter, self.requests = generator, data_iter, requests
    self.max_staleness = max_staleness
    self._pending = {}  # step -> (data state before its draw, records, future of results)
    self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='rollouts')
                  if max_staleness else None)

  def _generate(self, records, t):
    return self.generator.generate(self.requests(records, t))

  def take(self, t: int):
    """(records, results, metrics) of step t; launches the batches up to step t + s."""
    version, regenerated = self.generator.weight_version, 0.0
    if t in self._pending:
      _, records, future = self._pending.pop(t)
      results = future.result()
      if any(version - r.weight_version > self.max_staleness for r in results):
        results, regenerated = self._generate(records, t), 1.0
    else:
      records = next(self.data_iter)
      results = self._generate(records, t)
    for k in range(t + 1, t + self.max_staleness + 1):
      if k not in self._pending:
        state = self.data_iter.get_state()
        records_k = next(self.data_iter)
        self._pending[k] = (state, records_k, self._pool.submit(self._generate, records_k, k))
    metrics = staleness_metrics(results, version)
    if self.max_staleness:
      metrics['stale_regenerated'] = regenerated
    return records, results, metrics

  def wait(self):
    """Lets the launched generation finish (before an update is sent; raises its errors)."""
    for _, _, future in self._pending.values():
      future.result()

  def data_state(self):
    """The data-iterator state to checkpoint: before the pending batches' draws."""
    if self._pending:
      return self._pending[min(self._pending)][0]
    return self.data_iter.get_state()

  def get_state(self) -> list:
    """The pending batches' completions (JSON); their records are redrawn on restore."""
    self.wait()
    return [{'step': k, 'results': [dataclasses.asdict(r) for r in f.result()]}
            for k, (_, _, f) in sorted(self._pending.items())]

  def set_state(self, pending: list):
    """Restores `get_state`'s batches; the data iterator must be at `data_state`."""
    for item in pending:
      state = self.data_iter.get_state()
      future = concurrent.futures.Future()
      future.set_result([GenerationResult(**r) for r in item['results']])
      self._pending[int(item['step'])] = (state, next(self.data_iter), future)

  def close(self):
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
