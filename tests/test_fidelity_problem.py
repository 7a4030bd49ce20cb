"""`fidelity.decoder_problem`: the library's decoder as a fidelity `Problem`."""
import jax.numpy as jnp
import numpy as np

from logra_jax.analysis import fidelity
from logra_jax.analysis.tiny_lm import token_nll


def test_decoder_problem_loss_is_the_decoders_next_token_nll():
  problem = fidelity.decoder_problem('tiny', batch=2, length=5, seed=3)
  assert problem.dtype == jnp.float32 and problem.tokens_BxL.shape == (2, 5)
  assert int(problem.tokens_BxL.max()) < problem.model.config.vocab_size
  variables = {'params': problem.params}
  logits, _ = problem.model.apply(variables, problem.tokens_BxL)  # Transformer: (logits, cache)
  want = token_nll(logits, problem.tokens_BxL)
  np.testing.assert_array_equal(problem.loss(variables, problem.tokens_BxL), want)
  assert np.isfinite(float(want)) and float(want) > 0
