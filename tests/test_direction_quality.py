"""experiments/direction_quality.py: the direction-quality probe's numbers (issue 23).

float64 on the tiny test model of test_train_steps (its fixture), two batches that differ
in their advantages:
  - for D = the dense gradient, the score is ⟨g_a, g_b⟩ / √q with the dot product taken in
    numpy and q from central finite differences of the logits (not the JVP the probe uses);
  - a random direction scores 0 within 4 s.e. over 16 draws;
  - the LoGRA candidate is the trainer's own update: Aᵀ U of `logra_update_fn` (α divided
    out) on the same projections, to 1e-9.
"""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax import sketch
from logra_jax.train import completion, optimizers
from logra_jax.train import steps
from logra_jax.train.config import LograSection, OptimSection
from test_train_steps import P, loss_config, setup  # noqa: F401  pylint: disable=unused-import

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'experiments'))
import direction_quality as dq  # noqa: E402  pylint: disable=g-import-not-at-top

ROWS = 4  # every row of the fixture's batch in the KL probe
TEMP = 1.0


@pytest.fixture(scope='module')
def two_batches(setup):  # noqa: F811
  _, model, params, batch, _ = setup
  with jax.enable_x64(True):
    other = dict(batch, advantages=jnp.asarray([-0.3, 1.2, 0.4, -1.0], jnp.float64))
    cfg = loss_config()
    ga = dq.dense_gradient(model, cfg, params, batch, P)
    gb = dq.dense_gradient(model, cfg, params, other, P)
  return model, params, batch, ga, gb


def _flat64(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _q_by_finite_differences(model, params, d, batch, eps=1e-5):
  """q = ½ mean over target positions of Var_softmax(z)[ż], ż by central differences."""
  fwd = lambda w: np.asarray(completion.forward(model, {'params': w}, batch, P), np.float64)
  shift = lambda s: jax.tree.map(lambda p, x: p + s * x, params, d)
  z, zdot = fwd(params), (fwd(shift(eps)) - fwd(shift(-eps))) / (2 * eps)
  pz = np.exp(z - z.max(-1, keepdims=True))
  pz /= pz.sum(-1, keepdims=True)
  var = (pz * zdot**2).sum(-1) - (pz * zdot).sum(-1) ** 2
  mask = np.asarray(batch['target_mask'])
  return 0.5 * (var * mask).sum() / mask.sum()


def test_dense_gradient_score_is_the_dot_over_root_q(two_batches):
  model, params, batch, ga, gb = two_batches
  with jax.enable_x64(True):
    d = jax.tree.map(jnp.negative, ga)
    got = dq.score(model, params, d, gb, batch, P, TEMP, ROWS)
    q = _q_by_finite_differences(model, params, d, batch)
  dot = float(np.dot(_flat64(ga), _flat64(gb)))
  assert got['gain'] == pytest.approx(dot, rel=1e-12)
  assert got['q'] == pytest.approx(q, rel=1e-6)  # central differences: O(eps²) ~ 1e-10
  assert got['score'] == pytest.approx(dot / np.sqrt(q), rel=1e-6)


def test_a_random_direction_scores_zero_within_its_standard_error(two_batches):
  model, params, batch, _, gb = two_batches
  scores = []
  with jax.enable_x64(True):
    leaves, tree = jax.tree.flatten(params)
    for i in range(16):
      keys = jax.random.split(jax.random.key(i), len(leaves))
      d = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype)
                                    for k, x in zip(keys, leaves)])
      scores.append(dq.score(model, params, d, gb, batch, P, TEMP, ROWS)['score'])
  m, se = dq.mean_se(scores)
  assert abs(m) < 4 * se, (m, se)
  grad_score = dq.score(model, params, jax.tree.map(jnp.negative, gb), gb, batch, P, TEMP,
                        ROWS)['score']
  assert grad_score > 10 * se  # the check has power: the gradient itself scores far above


def test_the_logra_candidate_is_the_trainers_update(two_batches):
  model, params, batch, ga, _ = two_batches
  optim = OptimSection(logra=LograSection(rank=4, learning_rate=1.0, update_ratio=1e-2))
  seed, t = 0, 3
  with jax.enable_x64(True):
    params64 = params
    d = dq.logra_direction(optim, params64, ga, seed, t)
    a = optimizers.projections_at(optim.logra, params64, seed, t)
    a = jax.tree.map(lambda x: x.astype(jnp.float64), a)
    opt = optimizers.logra_optimizer(optim, 1)
    sc = steps.StepConfig(prompt_len=P, micro_batches=1, kl_sequences=ROWS, kl_control=False,
                          kl_probe='jvp', alpha_max=1.0, sparse_mask=0.0, return_update=True)
    update = steps.logra_update_fn(model, loss_config(), opt, sc)
    state = opt.init(sketch.zero_probes(params64, a))
    new, _, metrics, applied = update(jax.tree.map(jnp.array, params64), state, batch, a,
                                      jnp.float64(1e-4), jax.random.key(0))
    moved = jax.tree.map(lambda n, p: n - p, new, params64)  # α = 1 (kl_control off)
    wire = jax.tree.map(sketch.expand_update, a, applied)  # the generators' α·U: fp32
  assert float(metrics['alpha']) == 1.0
  # The trainer's float64 params moved by exactly the probe's direction (kernels: Aᵀ U in
  # float64; everything else: not at all).
  flat_d, flat_m = traverse_util.flatten_dict(d), traverse_util.flatten_dict(moved)
  kernels = set(traverse_util.flatten_dict(wire))
  assert kernels and set(flat_m) - kernels
  for path, m in flat_m.items():
    scale = max(float(np.max(np.abs(m))), 1e-300)
    np.testing.assert_allclose(np.asarray(flat_d[path]), np.asarray(m), atol=1e-9 * scale,
                               rtol=0, err_msg=str(path))
    if path not in kernels:
      assert not np.any(np.asarray(flat_d[path])), path
  # The update the step hands the generators is U in fp32 (the wire's dtype): the same to
  # fp32 rounding (2^-24 of each entry, summed over R = 4 terms of Aᵀ U).
  for path, w in traverse_util.flatten_dict(wire).items():
    np.testing.assert_allclose(np.asarray(flat_d[path]), np.asarray(w), rtol=0,
                               atol=4 * 2.0**-24 * float(np.max(np.abs(w))))


def test_summarize_reports_logra_over_adamw():
  pairs = [{'adamw': {'score': 2.0, 'q': 1.0}, 'logra': {'score': 1.0, 'q': 1.0}},
           {'adamw': {'score': 4.0, 'q': 1.0}, 'logra': {'score': 3.0, 'q': 1.0}}]
  s = dq.summarize(pairs)
  assert s['logra_over_adamw'] == pytest.approx(2.0 / 3.0)
  assert s['directions']['logra']['score_se'] == pytest.approx(1.0)
  # Paired: LoGRA minus AdamW is -1 on both pairs: mean -1, s.e. 0.
  assert s['directions']['logra']['minus_adamw_mean'] == pytest.approx(-1.0)
  assert s['directions']['logra']['minus_adamw_se'] == pytest.approx(0.0)
  assert dataclasses.is_dataclass(OptimSection())


def test_the_logra_candidate_with_a_trained_rest_is_the_trainers_update(two_batches):
  """optim.logra.rest_learning_rate: the candidate also carries the unsketched leaves' Adam
  step, as the trainer's step (α = 1) moves them."""
  model, params, batch, ga, _ = two_batches
  optim = OptimSection(logra=LograSection(rank=4, learning_rate=1.0, update_ratio=1e-2,
                                          rest_learning_rate=1e-3))
  seed, t = 0, 3
  with jax.enable_x64(True):
    d = dq.logra_direction(optim, params, ga, seed, t)
    a = jax.tree.map(lambda x: x.astype(jnp.float64),
                     optimizers.projections_at(optim.logra, params, seed, t))
    opt, rest_opt = optimizers.logra_optimizer(optim, 1), optimizers.rest_optimizer(optim, 1)
    sc = steps.StepConfig(prompt_len=P, micro_batches=1, kl_sequences=ROWS, kl_control=False,
                          kl_probe='jvp', alpha_max=1.0, sparse_mask=0.0)
    update = steps.logra_update_fn(model, loss_config(), opt, sc, rest_opt=rest_opt)
    state = (opt.init(sketch.zero_probes(params, a)), rest_opt.init(sketch.rest_of(params, a)))
    new, _, _ = update(jax.tree.map(jnp.array, params), state, batch, a, jnp.float64(1e-4),
                       jax.random.key(0))
    moved = traverse_util.flatten_dict(jax.tree.map(lambda n, p: n - p, new, params))
  flat_d = traverse_util.flatten_dict(d)
  rest = set(traverse_util.flatten_dict(sketch.rest_of(params, a)))
  assert rest and all(np.any(np.asarray(flat_d[p])) for p in rest)
  for path, m in moved.items():
    scale = max(float(np.max(np.abs(m))), 1e-300)
    np.testing.assert_allclose(np.asarray(flat_d[path]), np.asarray(m), atol=1e-9 * scale,
                               rtol=0, err_msg=str(path))


# ------------------------------------------------------------------- the form objective

def _loglik_numpy(model, params, batch):
  """The mean over rows of Σ_t log softmax(z)[target] · mask, the softmax taken in numpy."""
  z = np.asarray(completion.forward(model, {'params': params}, batch, P), np.float64)
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  tok = np.take_along_axis(logp, np.asarray(batch['targets'])[..., None], -1)[..., 0]
  return float((tok * np.asarray(batch['target_mask'])).sum(1).mean())


def test_the_form_loglik_and_its_chunked_gradient(setup):  # noqa: F811
  _, model, params, batch, _ = setup
  with jax.enable_x64(True):
    got = float(dq.loglik(model, params, batch, P))
    value, grad = dq.chunked_loglik_and_grad(model, params, batch, P, chunk=2)
    forward_only = dq.chunked_loglik(model, params, batch, P, chunk=1)
    whole = jax.grad(lambda p: dq.loglik(model, p, batch, P))(params)
    want = _loglik_numpy(model, params, batch)
  assert got == pytest.approx(want, rel=1e-12)
  assert value == pytest.approx(got, rel=1e-12)  # chunks of 2 rows average to the whole
  assert forward_only == pytest.approx(got, rel=1e-12)
  np.testing.assert_allclose(_flat64(grad), _flat64(whole), rtol=1e-10, atol=1e-14)
  with pytest.raises(ValueError, match='do not split into chunks of 3'):
    dq.chunked_loglik_and_grad(model, params, batch, P, chunk=3)


def test_form_scores_are_the_dot_over_root_q(two_batches):
  model, params, batch, ga, gb = two_batches
  with jax.enable_x64(True):
    d = jax.tree.map(jnp.negative, ga)
    got = dq.form_scores(model, params, d, {'x': gb, 'y': ga}, batch, P, TEMP, ROWS)
    q = dq.score(model, params, d, gb, batch, P, TEMP, ROWS)['q']
  dot_x = -float(np.dot(_flat64(ga), _flat64(gb)))
  dot_y = -float(np.dot(_flat64(ga), _flat64(ga)))
  assert got['x']['gain'] == pytest.approx(dot_x, rel=1e-12)
  assert got['y']['gain'] == pytest.approx(dot_y, rel=1e-12)
  assert got['x']['q'] == got['y']['q'] == pytest.approx(q, rel=1e-12)
  assert got['y']['score'] == pytest.approx(dot_y / np.sqrt(q), rel=1e-12)


ARITH = {'question': 'Calculate 58 - 29.', 'answer': '29',
         'metadata': {'source_dataset': 'basic_arithmetic', 'expression': '58 - 29'}}


def test_form_text_writes_a_correct_answer_in_each_form():
  assert dq.form_text('terse', ARITH) == '58 - 29 equals 29.'
  assert dq.form_text('template', ARITH) == (
      'To calculate 58 - 29, you simply add them together: 58 - 29 = 29.')
  with pytest.raises(ValueError, match='reasoning-gym arithmetic'):
    dq.form_text('terse', '12')  # tiny's references are plain answers


class _Chars:
  """A tokenizer stand-in: one id per character (ord % 50 + 3), no special tokens."""

  def encode(self, text, add_special_tokens=True):
    assert not add_special_tokens
    return [ord(c) % 50 + 3 for c in text]


def test_form_batch_is_the_prompt_then_the_answer_and_its_stop():
  task = dataclasses.make_dataclass('T', ['tokenizer', 'pad_id', 'stop_ids', 'prompt_len'])(
      _Chars(), 0, (2,), 8)
  task.prompt_ids = lambda r: r['prompt_ids']
  task.reference = lambda r: r['reference']
  records = [{'prompt_ids': [5, 6, 7], 'reference': ARITH},
             {'prompt_ids': [9] * 8, 'reference': dict(ARITH, answer='30')}]
  batch, p = dq.form_batch(task, 'terse', records)
  text = '58 - 29 equals 29.'
  want = [ord(c) % 50 + 3 for c in text] + [2]
  assert p == 8 and batch['tokens'].shape[0] == 2
  np.testing.assert_array_equal(batch['tokens'][0, :p], [0] * 5 + [5, 6, 7])
  np.testing.assert_array_equal(batch['targets'][0, :len(want)], want)
  assert batch['target_mask'][0].sum() == len(want) == batch['target_mask'][1].sum()
  assert batch['targets'].shape[1] % 8 == 0 and batch['targets'].shape[1] >= len(want)


def test_copy_policy_keeps_only_the_asked_checkpoint(tmp_path):
  run = tmp_path / 'run'
  for s in ('40', '50'):
    (run / 'checkpoints' / s).mkdir(parents=True)
    (run / 'checkpoints' / s / 'x').write_text(s)
  (run / 'metrics.jsonl').write_text('{}')
  dq.copy_policy(str(run), str(tmp_path / 'p40'), 40)
  assert sorted(os.listdir(tmp_path / 'p40' / 'checkpoints')) == ['40']
  assert not (tmp_path / 'p40' / 'metrics.jsonl').exists()
  dq.copy_policy(str(run), str(tmp_path / 'all'))
  assert sorted(os.listdir(tmp_path / 'all' / 'checkpoints')) == ['40', '50']
  with pytest.raises(dq.app.UsageError, match=r"no checkpoint 45 \(it has \['40', '50'\]\)"):
    dq.copy_policy(str(run), str(tmp_path / 'p45'), 45)
