"""The embedded JAX generator: `logra_jax.rl.Generator` requests answered by the in-process
KV-cache sampler (`sampler.py`). The trainer's default engine, and the bridge engine's.

Shape key: U distinct prompts (bucketed), n samples each, P prompt length (left padded).
"""
from typing import Sequence

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
