"""Vocabulary-chunked losses / KL probes and blockwise attention against the dense references.

Numbers: float64 (the `x64` fixture), tiny shapes. A chunked or blockwise computation sums
the same terms as the dense one in another order (per chunk, then merged with an online
max/rescale), so in float64 they agree to a few ulps of the largest term: O(1) logits over
V <= 16 and softmax sums give |error| ~ 1e-15 (measured <= 4e-14 on the gradients). The bound
1e-11 relative to the largest entry leaves three orders of margin and still catches any real
error (a dropped or double-counted chunk moves values by > 1e-2).

Memory claims are checked on the traced programs (forward and backward): no array with the
(L, L) score shape in blockwise attention, no (tokens, V) array in the chunked losses; and on
the compiled CPU programs' temp bytes against the dense paths.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numerics
from logra_jax import sketch
from logra_jax.analysis import hlo
from logra_jax.models import attention as attn
from logra_jax.models.kv_cache import init_cache
from logra_jax.models.positions import causal_mask
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl import blockwise
from logra_jax.rl import losses as rl_losses
from logra_jax.train import completion, optimizers, steps
from logra_jax.train.steps import kl_probe
from logra_jax.train.steps import losses as step_losses
from logra_jax.train.config import OptimSection

pytestmark = pytest.mark.usefixtures('x64')
RTOL = 1e-11
B, T, D, V = 3, 4, 5, 13
TEMP = 0.7

close = functools.partial(numerics.close, rtol=RTOL)
close_trees = functools.partial(numerics.close_trees, rtol=RTOL)


def head_data(vocab_axis):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(B, T, D)))
  w = jnp.asarray(2.0 * rng.normal(size=(V, D)))
  w = w if vocab_axis == 0 else w.T
  return h, w, jnp.asarray(rng.integers(0, V, (B, T))), jnp.asarray(rng.random((B, T)) > 0.3)


def dense_logits(h, w, vocab_axis):
  return jnp.einsum('btd,vd->btv' if vocab_axis == 0 else 'btd,dv->btv', h, w)


# 5 does not divide V = 13 (a clamped, overlapping last chunk); 1 is one entry per chunk;
# 20 > V is clipped to V (one chunk). Layouts: tied embedding (V, D) = 0, LM head (D, V) = 1.
@pytest.mark.parametrize('vocab_axis,chunk', [(0, 1), (0, 5), (0, 20), (1, 5)])
def test_chunked_logprobs_and_entropy_and_their_gradients(vocab_axis, chunk):
  h, w, y, _ = head_data(vocab_axis)

  def chunked(h, w):
    return blockwise.token_logprobs_and_entropy(h, w, y, TEMP, vocab_axis=vocab_axis,
                                                chunk=chunk)

  def dense(h, w):
    z = dense_logits(h, w, vocab_axis)
    return rl_losses.token_logprobs(z, y, TEMP), rl_losses.token_entropy(z, TEMP)

  for got, want in zip(chunked(h, w), dense(h, w)):
    close(got, want)
  # A scalar mixing both outputs nonlinearly, so every cotangent path is exercised.
  scalar = lambda f: lambda h, w: jnp.sum(jnp.sin(f(h, w)[0]) + f(h, w)[1] ** 2)
  close_trees(jax.grad(scalar(chunked), (0, 1))(h, w), jax.grad(scalar(dense), (0, 1))(h, w))


@pytest.mark.parametrize('vocab_axis,chunk', [(0, 4), (1, 5)])
def test_chunked_mean_kl_and_kl_coefficient_and_their_gradients(vocab_axis, chunk):
  h, w, _, mask = head_data(vocab_axis)
  rng = np.random.default_rng(1)
  h_q = h + 0.1 * jnp.asarray(rng.normal(size=h.shape))
  w_q = w + 0.1 * jnp.asarray(rng.normal(size=w.shape))
  h_dot = jnp.asarray(rng.normal(size=h.shape))
  kw = dict(vocab_axis=vocab_axis, chunk=chunk)
  z = lambda h, w: dense_logits(h, w, vocab_axis)

  kl_c = lambda hp, wp, hq, wq: sketch.chunked_mean_kl(hp, wp, hq, wq, TEMP, mask, **kw)
  kl_d = lambda hp, wp, hq, wq: sketch.mean_kl(z(hp, wp), z(hq, wq), TEMP, mask)
  args = (h, w, h_q, w_q)
  close(kl_c(*args), kl_d(*args))
  close_trees(jax.grad(kl_c, (0, 1, 2, 3))(*args), jax.grad(kl_d, (0, 1, 2, 3))(*args))

  q_c = lambda h, hd, w: sketch.chunked_kl_coefficient(h, hd, w, TEMP, mask, **kw)
  q_d = lambda h, hd, w: sketch.kl_coefficient(z(h, w), z(hd, w), TEMP, mask)
  close(q_c(h, h_dot, w), q_d(h, h_dot, w))
  close_trees(jax.grad(q_c, (0, 1, 2))(h, h_dot, w), jax.grad(q_d, (0, 1, 2))(h, h_dot, w))


def test_chunked_kl_coefficient_has_no_cancellation_when_the_tangent_mean_is_large():
  """ż = 1e6 + O(1): E[ż²] − E[ż]² drops ~12 of 16 digits; Chan's merge does not."""
  h, w, _, mask = head_data(0)
  rng = np.random.default_rng(2)
  zdot = jnp.asarray(1e6 + rng.normal(size=(B, T, V)))
  # ż = ḣ·w is linear in ḣ: realise this ż exactly with an identity-like head of width V.
  eye = jnp.eye(V)
  h_full = dense_logits(h, w, 0)
  q = sketch.chunked_kl_coefficient(h_full, zdot, eye, TEMP, mask, vocab_axis=0, chunk=4)
  close(q, sketch.kl_coefficient(h_full, zdot, TEMP, mask), rtol=1e-9)


@pytest.mark.parametrize('tie', [False, True])
def test_forward_runs_the_head_on_the_completion_positions_as_the_model_does(tie):
  """`completion.forward` (vocab_chunk 0) applies the head to the T completion positions only;
  its logits are the model's own logits at those positions, bit for bit, fp32 and float64."""
  for dtype in ('float32', 'float64'):
    mc = get_preset('tiny', vocab_size=V, hidden_size=16, intermediate_size=24, num_layers=1,
                    num_heads=2, num_kv_heads=1, tie_embeddings=tie, dtype=dtype,
                    param_dtype=dtype)
    model = Transformer(mc)
    params = init_params(mc, jax.random.key(0))
    p, t = 3, 4
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, p + t)), jnp.int32)
    mask = jnp.ones((2, p + t), bool).at[0, 0].set(False)
    batch = dict(tokens=tokens, mask=mask, targets=tokens[:, p:])
    logits, _ = model.apply({'params': params}, tokens, attn_mask_BxL=mask)
    out = completion.forward(model, {'params': params}, batch, p)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits[:, p - 1:p - 1 + t]))


def test_bad_chunk_and_head_are_errors():
  h, w, y, _ = head_data(0)
  with pytest.raises(ValueError, match='vocab chunk'):
    blockwise.token_logprobs_and_entropy(h, w, y, vocab_axis=0, chunk=0)
  with pytest.raises(ValueError, match='vocab_axis'):
    blockwise.token_logprobs_and_entropy(h, w, y, vocab_axis=2, chunk=4)


# ------------------------------------------------------------------------------- attention

def qkv(b=2, l=11, h=4, kv=2, e=8, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(b, l, n, e))) for n in (h, kv, kv))


def padding_and_segments(b=2, l=11):
  mask = np.ones((b, l), bool)
  mask[0, :3] = False  # left padding: rows 0..2 of sequence 0 attend to nothing
  seg = np.zeros((b, l), np.int32)
  seg[1, 6:] = 1       # two packed segments in sequence 1
  return jnp.asarray(mask), jnp.asarray(seg)


@pytest.mark.parametrize('block', [1, 4, 16])  # 4 does not divide L = 11; 16 > L
def test_blockwise_attention_equals_dense_with_padding_and_segments(block):
  q, k, v = qkv()
  mask, seg = padding_and_segments()
  dense = lambda q, k, v: attn.dense_attention(q, k, v, causal_mask(mask, seg))
  blocked = lambda q, k, v: attn.blockwise_attention(q, k, v, mask, seg, block=block)
  # Every row, the fully masked (padding) ones included: both average all keys uniformly.
  close(blocked(q, k, v), dense(q, k, v))
  scalar = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  close_trees(jax.grad(scalar(blocked), (0, 1, 2))(q, k, v),
              jax.grad(scalar(dense), (0, 1, 2))(q, k, v))
  tangents = qkv(seed=1)  # forward mode: the KL probe's JVP runs through attention
  close(jax.jvp(blocked, (q, k, v), tangents)[1], jax.jvp(dense, (q, k, v), tangents)[1])


def test_blockwise_attention_equals_dense_with_a_cache(block=3):  # 3 divides neither 5 nor 7
  q, k, v = qkv(l=5)
  k_c, v_c, _ = qkv(l=7, h=2, seed=2)
  cache_mask = jnp.asarray(np.random.default_rng(3).random((2, 7)) > 0.4)
  mask = jnp.ones((2, 5), bool)
  cached = (k_c, v_c, cache_mask)
  close(attn.blockwise_attention(q, k, v, mask, None, cached, block=block),
        attn.dense_attention(q, k, v, causal_mask(mask), cached))


def tiny_config(**kw):
  base = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2, max_position_embeddings=64, dtype='float64',
              param_dtype='float64')
  return get_preset('tiny', **{**base, **kw})


def test_transformer_blockwise_prefill_and_decode_equal_dense():
  """Left-padded prefill into a KV cache, then cached one-token decode steps."""
  dense_cfg = tiny_config()
  blocked_cfg = dense_cfg.replace(attention='blockwise', attention_block=3)
  params = init_params(dense_cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(1, 16, (2, 5)))
  prompt_mask = jnp.asarray([[False, False, True, True, True], [True] * 5])
  steps_tokens = jnp.asarray(rng.integers(1, 16, (3, 2, 1)))

  def run(cfg):
    model = Transformer(cfg)
    cache = init_cache(cfg, 2, 9)  # 9 slots: not a multiple of the block
    logits, cache = model.apply({'params': params}, prompt, attn_mask_BxL=prompt_mask,
                                cache=cache)
    out = [logits[prompt_mask]]  # the real prompt positions
    for tok in steps_tokens:
      logits, cache = model.apply({'params': params}, tok, cache=cache)
      out.append(logits)
    return out

  for got, want in zip(run(blocked_cfg), run(dense_cfg)):
    close(got, want)


def test_transformer_blockwise_with_segments_equals_dense():
  dense_cfg = tiny_config()
  params = init_params(dense_cfg, jax.random.key(1))
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, 16, (2, 11)))
  mask, seg = padding_and_segments()
  run = lambda cfg: Transformer(cfg).apply({'params': params}, tokens, segment_ids_BxL=seg,
                                           attn_mask_BxL=mask)[0]
  close(run(dense_cfg.replace(attention='blockwise', attention_block=4)), run(dense_cfg))


def test_bad_attention_settings_are_errors():
  with pytest.raises(ValueError, match='ModelConfig.attention must be one of'):
    tiny_config(attention='flash')
  with pytest.raises(ValueError, match='ModelConfig.attention_block'):
    tiny_config(attention_block=0)
  with pytest.raises(ValueError, match='ModelConfig.vocab_chunk'):
    tiny_config(vocab_chunk=-1)


# ------------------------------------------------------------------- the steps, end to end

N, P, TC = 4, 4, 3  # sequences, prompt length (left padded), completion length
MEMORY_SAFE = dict(vocab_chunk=5, attention='blockwise', attention_block=3)  # 5 ∤ 16, 3 ∤ 7


def loss_config():
  return rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),), entropy_coef=0.01,
                              kl_coef=0.05)


@pytest.fixture(scope='module')
def step_setup():
  with jax.enable_x64(True):
    mc = tiny_config(num_heads=2, num_kv_heads=1)
    params = init_params(mc, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = np.zeros((N, P + TC), np.int32)
    mask = np.zeros((N, P + TC), bool)
    tmask = np.zeros((N, TC))
    for i, (p, c) in enumerate(zip((4, 3, 2, 4), (3, 2, 3, 1))):
      tokens[i, P - p:P + c] = rng.integers(3, 16, p + c)
      mask[i, P - p:P + c] = True
      tmask[i, :c] = 1.0
    batch = dict(tokens=tokens, mask=mask, targets=tokens[:, P:], target_mask=tmask,
                 advantages=rng.normal(size=N))
    ref = steps.make_ref_logp(Transformer(mc), P, 1.0)(params, batch)
    batch['behaviour_logp'] = np.asarray(ref) + rng.uniform(-0.1, 0.1, (N, TC))
    batch['ref_logp'] = np.asarray(ref) + rng.uniform(-0.1, 0.1, (N, TC))
    batch = jax.tree.map(jnp.asarray, batch)
    a = sketch.make_projections(params, seed=0, step=1, ranks=4, dtype=jnp.float64)
  return mc, params, batch, a


def test_chunked_loss_gives_the_same_loss_metrics_and_sketch_with_tied_embeddings(step_setup):
  """The tied head (V, D); the untied (D, V) one runs in the end-to-end steps below."""
  mc, params, batch, a = step_setup
  mc = mc.replace(tie_embeddings=True)
  params = {k: v for k, v in params.items() if k != 'lm_head'}
  out = {}
  for name, cfg in (('dense', mc), ('chunked', mc.replace(**MEMORY_SAFE))):
    loss = step_losses.loss_fn(Transformer(cfg), loss_config(), P)
    out[name] = jax.jit(sketch.sketch_value_and_grad(loss, has_aux=True))(params, a, batch, 1.0)
  (value, metrics), sketches = out['chunked']
  (value_d, metrics_d), sketches_d = out['dense']
  close(value, value_d)
  assert metrics.keys() == metrics_d.keys()
  for k in metrics:
    close(metrics[k], metrics_d[k])
  close_trees(sketches, sketches_d)


def test_memory_safe_logra_and_dense_steps_equal_the_default_steps(step_setup):
  mc, params, batch, a = step_setup
  sc = steps.StepConfig(prompt_len=P, micro_batches=2, kl_sequences=N, kl_control=True,
                        kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0)
  logra_opt = optimizers.logra_optimizer(OptimSection(), total_steps=10)
  adam_opt = optimizers.adam_optimizer(OptimSection(name='adam'), total_steps=10)
  copy = lambda tree: jax.tree.map(jnp.array, tree)
  results = {}
  for name, cfg in (('dense', mc), ('safe', mc.replace(**MEMORY_SAFE))):
    model = Transformer(cfg)
    # A drawn in the step: the fixture's a (seed 0, step 1, rank 4), float64.
    logra = steps.make_logra_step(model, loss_config(), logra_opt, sc,
                                  steps.ProjectionSpec(4, dtype=jnp.float64))
    state = logra_opt.init(sketch.zero_probes(params, a))
    new, _, metrics = logra(copy(params), state, batch, 0, 1, jnp.float64(1e-4),
                            jax.random.key(0))
    dense = steps.make_dense_step(model, loss_config(), adam_opt, sc)
    new_d, _, metrics_d = dense(None, copy(params), adam_opt.init(params), batch)
    results[name] = new, metrics, new_d, metrics_d
  safe, ref = results['safe'], results['dense']
  assert ref[1]['skipped'] == 0 and ref[3]['skipped'] == 0
  # Params after the step (the dense step's follow its gradient, LM head included) and every
  # metric (loss, entropy, mismatch, q, α, realised KL, ...).
  for got, want in zip(safe, ref):
    close_trees(got, want)


def test_chunked_finite_difference_probe_equals_the_dense_one(step_setup):
  mc, params, batch, a = step_setup
  rng = np.random.default_rng(4)
  probes = sketch.zero_probes(params, a)
  u = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), probes)
  qs = []
  for cfg in (mc, mc.replace(**MEMORY_SAFE)):
    model = Transformer(cfg).clone(sketch_mode='linear')
    out_fn = lambda p, model=model: completion.forward(
        model, sketch.sketch_variables(params, a, p), batch, P)
    # The FD probe at the step a budget of 1e-3 allows (the trainer's; float64 here).
    probe = jax.jit(lambda pr, u, model=model: kl_probe.probe_kl(
        Transformer(cfg), out_fn, model, pr, u, 'fd', 1e-3, 1.0, batch['target_mask'])[1])
    qs.append(probe(probes, u))
  close(qs[1], qs[0])


# ---------------------------------------------------------------------- the memory claims

def temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


LONG = 4096  # tokens: dense scores would be (1, 1, 2, 4096, 4096) fp32 = 128 MiB per layer


def long_attention_inputs():
  with jax.enable_x64(False):
    q, k, v = (jnp.zeros((1, LONG, n, 8), jnp.float32) for n in (2, 1, 1))
    return q, k, v, jnp.ones((1, LONG), bool)


def test_blockwise_attention_never_forms_an_l_by_l_array():
  with jax.enable_x64(False):
    q, k, v, mask = long_attention_inputs()
    blocked = lambda q, k, v: jnp.sum(attn.blockwise_attention(q, k, v, mask, block=512))
    dense = lambda q, k, v: jnp.sum(attn.dense_attention(q, k, v, causal_mask(mask)))
    grad = lambda f: jax.grad(f, (0, 1, 2))
    big = lambda shapes: [s for s, _ in shapes if len(s) >= 2 and s[-2:] == (LONG, LONG)]
    assert big(hlo.traced_shapes(dense, q, k, v))  # the check sees the dense scores
    assert not big(hlo.traced_shapes(blocked, q, k, v))
    assert not big(hlo.traced_shapes(grad(blocked), q, k, v))
    largest = max(np.prod(s) for s, _ in hlo.traced_shapes(grad(blocked), q, k, v))
    assert largest <= 2 * 512 * LONG  # (1, 1, 2, 512, 512) blocks, (1, 4096, ...) arrays
    # Compiled forward + backward temp bytes. The backward of one query block keeps its
    # (B, H, Q, L) scores and probabilities (Q/L = 1/8 of the L×L scores each): below a third
    # of one (2, L, L) fp32 score array (measured 35 MB vs 134 MB; dense 403 MB; one key
    # block of all L keys: 68 MB, which fails).
    scores = 2 * LONG * LONG * 4
    t_blocked, t_dense = temp_bytes(grad(blocked), q, k, v), temp_bytes(grad(dense), q, k, v)
    assert t_dense > scores > 3 * t_blocked, (t_dense, t_blocked)


def test_chunked_loss_never_forms_a_tokens_by_vocab_array():
  with jax.enable_x64(False):
    m, d, vocab, chunk = 512, 16, 4096, 512
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(m, 1, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, (m, 1)))

    def chunked(h, w):
      logp, ent = blockwise.token_logprobs_and_entropy(h, w, y, vocab_axis=1, chunk=chunk)
      return jnp.sum(logp) + jnp.sum(ent)

    def dense(h, w):
      z = jnp.einsum('btd,dv->btv', h, w)
      return jnp.sum(rl_losses.token_logprobs(z, y)) + jnp.sum(rl_losses.token_entropy(z))

    grad = lambda f: jax.grad(f, (0, 1))
    full = lambda shapes: [s for s, _ in shapes if np.prod(s) >= m * vocab]
    assert full(hlo.traced_shapes(grad(dense), h, w))
    assert not full(hlo.traced_shapes(grad(chunked), h, w))
    # Compiled forward + backward temp bytes: the chunked path needs less than ONE (M, V)
    # fp32 array (a few (M, C) chunk arrays: measured 5.3 MB vs 8.4 MB), the dense one ~4.
    logits_bytes = m * vocab * 4
    t_chunked, t_dense = temp_bytes(grad(chunked), h, w), temp_bytes(grad(dense), h, w)
    assert t_dense > 3 * logits_bytes > 3 * t_chunked, (t_dense, t_chunked)
