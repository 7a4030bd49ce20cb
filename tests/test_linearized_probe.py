"""`optim.logra.kl_probe='linearized'`: the KL probe's forward shared with its rows' loss
(`train/steps/linearized_probe.py`), against the 'jvp' step it replaces.

The claim: the same step (sketch, update, α, q, every metric; on a refresh the co-sketch and
the next A) in float64, with the probe rows' primal forward run once instead of twice. The
tolerance is the float64 steps' (tests/test_train_steps.py): the two steps sum the same terms
in different orders (the probe rows are a micro-batch of their own), ~1e-15 relative, which
the step's nonlinear parts amplify by a few orders at most; 1e-9 still catches a wrong weight,
a missing row or a tangent along the wrong direction (all O(1) relative).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch
from logra_jax.train import optimizers, steps
from logra_jax.train.config import LograSection, OptimSection
from logra_jax.train.steps import linearized_probe
from test_train_steps import (BUDGET, LOGRA_OPT, N, SEED, A_STEP, close, copy, flat,  # noqa: F401
                              loss_config, projection_spec, setup, step_config)

METRICS = ('loss', 'loss/policy', 'alpha', 'kl_coefficient', 'predicted_kl', 'realized_kl',
           'sketch_norm', 'entropy', 'mismatch', 'is_ratio', 'skipped')


def test_rows_and_micro_batches_of_the_unprobed_rows():
  assert linearized_probe.other_rows(32, 8) == [i for i in range(32) if i % 4]
  assert linearized_probe.other_rows(4, 4) == [] and linearized_probe.other_rows(4, 2) == [1, 3]
  # The fewest micro-batches, at least the step's, that split the rows evenly.
  assert linearized_probe.other_micro_batches(24, 8) == 8   # 3 rows each
  assert linearized_probe.other_micro_batches(8, 2) == 2
  assert linearized_probe.other_micro_batches(10, 4) == 5
  assert linearized_probe.other_micro_batches(7, 2) == 7
  assert linearized_probe.other_micro_batches(3, 8) == 3
  assert linearized_probe.other_micro_batches(0, 8) == 0
  # A prompt's 4 samples are contiguous: the unprobed 3 of each share their prompt.
  _, m_o, share, _ = linearized_probe.other_batch(
      {'target_mask': jnp.ones((32, 2))}, 8, 8, group=4)
  assert (m_o, share) == (8, 3)


def test_probe_rows_weight_by_hand():
  mask = jnp.asarray([[1., 1., 0.], [1., 0., 0.]])
  w, share = linearized_probe.probe_rows_weight({'target_mask': mask}, (12.0, 4), 'token')
  assert float(w) == float(share) == 0.25
  w, share = linearized_probe.probe_rows_weight({'target_mask': mask}, (12.0, 4), 'sequence')
  assert float(w) == 0.5 and float(share) == 0.25   # 2 of 4 rows; 3 of 12 tokens


def test_the_linear_cosketch_transposes_to_the_cosketch(x64):
  """`cosketch_matmul_linear` linearized at zero probe and coprobe, transposed: the sketch
  A G and the co-sketch G Bᵀ of the custom_vjp layer (`cosketch_matmul`), float64."""
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(2, 5, 6)), rng.normal(size=(6, 4))
  a, b, g = rng.normal(size=(3, 6)), rng.normal(size=(2, 4)), rng.normal(size=(2, 5, 4))
  zp, zc = jnp.zeros((3, 4)), jnp.zeros((6, 2))
  _, vjp = jax.vjp(lambda p, c: sketch.cosketch_matmul(x, w, a, p, b, c), zp, zc)
  want = vjp(jnp.asarray(g))
  y, lin = jax.linearize(lambda p, c: sketch.cosketch_matmul_linear(x, w, a, p, b, c), zp, zc)
  got = jax.linear_transpose(lin, zp, zc)(jnp.asarray(g))
  np.testing.assert_allclose(y, x @ w, rtol=1e-14)
  for u, v in zip(got, want):
    close(u, v, rtol=1e-13)
  close(want[1], np.einsum('blk,blr->kr', x, np.einsum('bld,rd->blr', g, b)), rtol=1e-13)


def _step(model, probe, m, n, aggregation, rest):
  rest_opt = (optimizers.rest_optimizer(
      OptimSection(logra=LograSection(rest_learning_rate=1e-3)), total_steps=10)
      if rest else None)
  return steps.make_logra_step(model, loss_config(aggregation), LOGRA_OPT,
                               step_config(m, kl_sequences=n, kl_probe=probe),
                               projection_spec(model), rest_opt=rest_opt), rest_opt


@pytest.mark.parametrize('m,n,aggregation,rest', [
    (1, 2, 'token', False), (2, 2, 'token', False), (1, 2, 'sequence', False),
    (2, 4, 'token', False), (1, 2, 'token', True), (2, 2, 'sequence', True)])
def test_the_linearized_step_is_the_jvp_step(x64, setup, m, n, aggregation, rest):
  """The whole step (params, optimizer state, metrics) with the shared forward equals the
  JVP probe's: probe rows 0, 2 of 4 (the others 1, 3 in their own micro-batches) or all 4
  (no other rows), token or sequence weights, with and without the densely trained rest."""
  _, model, params, batch, a = setup
  out = {}
  for probe in ('jvp', 'linearized'):
    step, rest_opt = _step(model, probe, m, n, aggregation, rest)
    state = LOGRA_OPT.init(sketch.zero_probes(params, a))
    if rest:
      state = (state, rest_opt.init(sketch.rest_of(params, a)))
    out[probe] = step(copy(params), copy(state), batch, np.uint32(SEED), np.uint32(A_STEP),
                      jnp.float64(BUDGET), jax.random.key(0))
  (p1, s1, m1), (p2, s2, m2) = out['jvp'], out['linearized']
  assert m1['skipped'] == 0 and 0.1 < m1['alpha'] < 3.0
  for k in METRICS:
    close(m2[k], m1[k])
  for path, w in flat(params).items():
    close(flat(p2)[path] - w, flat(p1)[path] - w)
  for x, y in zip(jax.tree.leaves(s2), jax.tree.leaves(s1)):
    close(x, y)


def test_the_linearized_refresh_is_the_jvp_refresh(x64, setup):
  """An adaptive subspace's refresh: the co-sketch of the probe rows comes from the same
  linearization (`cosketch_matmul_linear`), so the next A, the update and the metrics equal
  the JVP probe's refresh (2 micro-batches, probe rows 0 and 2)."""
  _, model, params, batch, a = setup
  opt = optimizers.logra_optimizer(
      OptimSection(logra=LograSection(learning_rate=1e-2, momentum=0.9)), total_steps=10)
  state = opt.init(sketch.zero_probes(params, a))
  rng = np.random.default_rng(7)
  mu = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape)),
                    sketch.zero_probes(params, a))
  state = (state[0], state[1]._replace(mu=mu)) + tuple(state[2:])
  out = {}
  for probe in ('jvp', 'linearized'):
    _, refresh = steps.make_adaptive_logra_step(
        model, loss_config(), opt, step_config(m=2, kl_sequences=2, kl_probe=probe), 1)
    out[probe] = refresh(copy(params), copy(state), batch, a, a, np.uint32(0), np.uint32(3),
                         np.uint32(5), jnp.float64(BUDGET), jax.random.key(0))
  (p1, s1, m1, a1), (p2, s2, m2, a2) = out['jvp'], out['linearized']
  assert m1['skipped'] == 0
  for k in METRICS:
    close(m2[k], m1[k])
  for x, y in zip(jax.tree.leaves((p2, s2, a2)), jax.tree.leaves((p1, s1, a1))):
    close(x, y)
