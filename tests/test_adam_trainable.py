"""optim.adam.trainable='sketched': AdamW on the kernels LoGRA sketches, every other param
frozen with no optimizer state (the parity study's arm that separates "fewer trained
parameters" from "sketch noise", issue 23).

AdamW is elementwise (no clipping by default), so on the trained kernels the masked
optimizer's update must equal full AdamW's bit for bit, and be exactly zero elsewhere.
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax import parallel, sketch
from logra_jax.models.presets import get_preset
from logra_jax.train import methods, optimizers
from logra_jax.train.config import AdamSection, OptimSection


def _params_and_grads():
  abstract = parallel.abstract_params(get_preset('tiny'))
  keys = iter(jax.random.split(jax.random.key(0), 64))
  rand = lambda x: jax.random.normal(next(keys), x.shape, jnp.float32)
  return jax.tree.map(rand, abstract), jax.tree.map(rand, abstract), abstract


def test_sketched_mask_marks_exactly_the_sketch_targets():
  abstract = parallel.abstract_params(get_preset('tiny'))
  flat = traverse_util.flatten_dict(methods.sketched_mask(abstract))
  targets = set(sketch.target_paths(abstract))
  assert {k for k, v in flat.items() if v} == targets
  assert any(not v for v in flat.values())  # embeddings and norm scales stay frozen


def test_masked_adamw_equals_adamw_on_the_kernels_and_is_zero_elsewhere():
  params, grads, abstract = _params_and_grads()
  o = OptimSection(name='adam', adam=AdamSection(learning_rate=1e-3, weight_decay=0.1))
  mask = methods.sketched_mask(abstract)
  full, part = optimizers.adam_optimizer(o, 10), optimizers.adam_optimizer(o, 10, mask)
  fs, ps = full.init(params), part.init(params)
  for _ in range(3):  # step 2 and 3 read the moments
    fu, fs = full.update(grads, fs, params)
    pu, ps = part.update(grads, ps, params)
    flat_f, flat_p = traverse_util.flatten_dict(fu), traverse_util.flatten_dict(pu)
    for path, trained in traverse_util.flatten_dict(mask).items():
      want = flat_f[path] if trained else np.zeros_like(flat_f[path])
      np.testing.assert_array_equal(np.asarray(flat_p[path]), np.asarray(want), str(path))
  # No moments for frozen params: the state holds only the trained kernels' mu and nu.
  kernel_bytes = sum(x.size for p, x in traverse_util.flatten_dict(params).items()
                     if p in set(sketch.target_paths(abstract)))
  floats = lambda s: sum(x.size for x in jax.tree.leaves(s) if x.ndim)
  assert floats(ps) == 2 * kernel_bytes < floats(fs)
