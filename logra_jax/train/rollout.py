"""The embedded JAX generator (the default `Generator`) and rollout → training-batch assembly.

Shape key: N completions, P prompt length (left padded), T = max_new_tokens, L = P + T.
"""
from typing import Sequence

import numpy as np

from logra_jax import parallel
from logra_jax.models.config import ModelConfig
from logra_jax.models.sampler import SamplingParams as EngineSampling
from logra_jax.models.sampler import (bucket_size, generate_arrays, pad_prompts, prompt_length,
                                      stop_array)
from logra_jax.rl.types import GenerationRequest, GenerationResult


class JaxGenerator:
  """Samples with the in-process KV-cache sampler; satisfies `logra_jax.rl.Generator`.

  All requests of one call share max_new_tokens, sampling settings and stop ids (one compiled
  program per shape bucket). The longest prompt plus max_new_tokens must fit the model's
  context (ValueError before generation). Per-completion seeds come from the request's seed,
  so a completion does not depend on the rest of the batch.
  """

  def __init__(self, config: ModelConfig, params, version: int = 0, pad_id: int = 0):
    self.config, self.params, self._version, self.pad_id = config, params, version, pad_id

  @property
  def weight_version(self) -> int:
    return self._version

  def update_weights(self, params, version: int, update=None):
    """The policy after step ``version`` (in process: the arrays themselves)."""
    del update
    self.params, self._version = params, version

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    if not requests:
      return []
    sp = requests[0].params
    if any(r.params.max_new_tokens != sp.max_new_tokens or r.params.temperature != sp.temperature
           or r.params.top_p != sp.top_p or r.params.top_k != sp.top_k
           or r.params.stop_token_ids != sp.stop_token_ids for r in requests):
      raise ValueError('JaxGenerator needs the same sampling settings (max_new_tokens, '
                       'temperature, top_p, top_k, stop_token_ids) for all requests of a call')
    prompts, seeds, owners = [], [], []
    for i, r in enumerate(requests):
      base = r.params.seed if r.params.seed is not None else i
      for j in range(r.params.n):
        prompts.append(r.prompt_token_ids)
        seeds.append((base * 1_000_003 + j) % (1 << 32))
        owners.append((r, j))
    n = len(prompts)
    b = bucket_size(n, 1)
    p = prompt_length(self.config, max(map(len, prompts)), sp.max_new_tokens)
    tokens, mask = pad_prompts(prompts, b, p, self.pad_id)
    seeds_b = np.zeros((b,), np.uint32)
    seeds_b[:n] = seeds
    out = generate_arrays(self.params, tokens, mask, seeds_b, stop_array(sp.stop_token_ids),
                          config=self.config, max_new_tokens=sp.max_new_tokens,
                          sampling=EngineSampling(sp.temperature, sp.top_p, sp.top_k))
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
