"""Engine-neutral rollout types: sampling parameters, requests, results, the Generator protocol.

The embedded JAX sampler, the HTTP bridge client and test mocks all satisfy `Generator`.
Every `GenerationResult` carries the completion token ids, one behaviour log-prob per
completion token, the finish reason and the weight version that produced it.
"""
import dataclasses
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

FINISH_REASONS = ('stop', 'length', 'abort')


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample completions.

  temperature: softmax temperature; 0 means greedy.
  top_p: nucleus mass in (0, 1]; 1 disables it.
  top_k: keep the k most likely tokens; 0 disables it.
  max_new_tokens: the most tokens generated per completion.
  stop_token_ids: generation of a completion ends after one of these (e.g. eos).
  n: completions per prompt (GRPO/RLOO groups); 1 for the running-baseline REINFORCE.
  seed: sampling seed; None lets the engine choose.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()
  n: int = 1
  seed: Optional[int] = None

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}.')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}.')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0 (0 disables it), got {self.top_k}.')
    if self.max_new_tokens < 1:
      raise ValueError(f'max_new_tokens must be >= 1, got {self.max_new_tokens}.')
    if self.n < 1:
      raise ValueError(f'n (samples per prompt) must be >= 1, got {self.n}.')
    object.__setattr__(self, 'stop_token_ids', tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """One prompt to complete `params.n` times.

  prompt_token_ids: the tokenised prompt (chat template already applied).
  params: the sampling parameters.
  request_id: caller's id, echoed in every result of this request.
  metadata: anything the caller wants back (e.g. the prompt record for the scorer).
  """
  prompt_token_ids: tuple[int, ...]
  params: SamplingParams = SamplingParams()
  request_id: str = ''
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    ids = tuple(int(t) for t in self.prompt_token_ids)
    if not ids:
      raise ValueError(f'request {self.request_id!r}: prompt_token_ids is empty.')
    if min(ids) < 0:
      raise ValueError(f'request {self.request_id!r}: negative token id in the prompt.')
    if not isinstance(self.params, SamplingParams):
      raise TypeError(f'params must be SamplingParams, got {type(self.params).__name__}.')
    object.__setattr__(self, 'prompt_token_ids', ids)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """One completion.

  request_id: the id of the request it answers.
  sample_index: which of the request's `n` samples, in [0, n).
  prompt_token_ids: the prompt, as sent.
  completion_token_ids: generated ids, including a final stop token if one was produced.
  behaviour_logprobs: log π_behaviour(token) of each completion token, at the sampling
    temperature; same length as completion_token_ids.
  finish_reason: 'stop' (stop token), 'length' (max_new_tokens) or 'abort'.
  weight_version: the generator's weight version that produced the completion.
  text: the decoded completion, if the engine decodes.
  """
  request_id: str
  sample_index: int
  prompt_token_ids: tuple[int, ...]
  completion_token_ids: tuple[int, ...]
  behaviour_logprobs: tuple[float, ...]
  finish_reason: str
  weight_version: int
  text: Optional[str] = None

  def __post_init__(self):
    object.__setattr__(self, 'prompt_token_ids', tuple(int(t) for t in self.prompt_token_ids))
    object.__setattr__(self, 'completion_token_ids',
                       tuple(int(t) for t in self.completion_token_ids))
    object.__setattr__(self, 'behaviour_logprobs',
                       tuple(float(x) for x in self.behaviour_logprobs))
    where = f'result {self.request_id!r}/{self.sample_index}'
    if len(self.behaviour_logprobs) != len(self.completion_token_ids):
      raise ValueError(
          f'{where}: {len(self.behaviour_logprobs)} behaviour log-probs for '
          f'{len(self.completion_token_ids)} completion tokens; need one per token.')
    if any(x > 1e-6 for x in self.behaviour_logprobs):
      raise ValueError(f'{where}: a behaviour log-prob is positive.')
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f'{where}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}.')
    if self.sample_index < 0 or self.weight_version < 0:
      raise ValueError(f'{where}: sample_index and weight_version must be >= 0.')


@runtime_checkable
class Generator(Protocol):
  """Anything that turns requests into completions: embedded sampler, HTTP client, mock."""

  @property
  def weight_version(self) -> int:
    """The version of the weights the next completions will be sampled with."""
    ...

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Returns `n` results per request, grouped by request, in request order."""
    ...
