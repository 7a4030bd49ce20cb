"""Where each token sits and what it may attend: rotary position embeddings (RoPE) and the
causal / padding / segment masks of the transformer's attention.

Shape key: B batch, L query length, H heads, E head dim.

Positions default to the count of real tokens before each token (left padding gives the same
logits as no padding), restarting at every segment. Keys that are padding, in the future or
in another segment are never attended; with `shared_prefix` segment 0 is a prefix that every
later segment attends (a prompt shared by the completions packed after it).
"""
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse frequencies (E/2,), float64, with 'linear' or 'llama3' scaling applied."""
  e = config.head_dim
  inv = 1.0 / config.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e)
  s = config.rope_scaling_dict
  kind = s.get('rope_type', 'default')
  if kind == 'linear':
    inv = inv / s['factor']
  elif kind == 'llama3':
    factor, lo, hi = s['factor'], s['low_freq_factor'], s['high_freq_factor']
    old_len = s['original_max_position_embeddings']
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    inv = np.where(medium, smoothed, scaled)
  return inv


def rope_sin_cos(config: ModelConfig, positions_BxL):
  """sin, cos of shape (B, L, E) in (at least) fp32, halves repeated as in HF Llama."""
  dtype = jnp.promote_types(jnp.float32, config.jnp_dtype)
  inv = jnp.asarray(rope_inv_freq(config), dtype)
  angle = positions_BxL.astype(dtype)[..., None] * inv
  angle = jnp.concatenate([angle, angle], axis=-1)
  return jnp.sin(angle), jnp.cos(angle)


def apply_rope(x_BxLxHxE, sin_BxLxE, cos_BxLxE):
  x1, x2 = jnp.split(x_BxLxHxE, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  sin, cos = sin_BxLxE[:, :, None], cos_BxLxE[:, :, None]
  return (x_BxLxHxE * cos + rotated * sin).astype(x_BxLxHxE.dtype)


def default_positions(attn_mask_BxL, segment_ids_BxL=None):
  """Index among real tokens (left padding safe), restarting at each segment boundary."""
  if segment_ids_BxL is not None:
    idx = jnp.arange(segment_ids_BxL.shape[1])
    start = jnp.concatenate([jnp.ones_like(segment_ids_BxL[:, :1], bool),
                             segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
  return jnp.maximum(jnp.cumsum(attn_mask_BxL, axis=1) - 1, 0)


def causal_mask(attn_mask_BxL, segment_ids_BxL=None, shared_prefix=False):
  """The (B, L, L) bool mask: query i attends key j <= i, real, and in its segment (or 0)."""
  l = attn_mask_BxL.shape[1]
  mask_BxLxL = jnp.tril(jnp.ones((l, l), bool))[None] & attn_mask_BxL[:, None, :]
  if segment_ids_BxL is not None:
    same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    if shared_prefix:
      same |= (segment_ids_BxL == 0)[:, None, :]
    mask_BxLxL &= same
  return mask_BxLxL


def attention_masks(config: ModelConfig, attn_mask_BxL, segment_ids_BxL, shared_prefix=False):
  """What `transformer.attention` needs: the (B, L, L) mask (dense) or the per-token masks
  (blockwise)."""
  if config.attention == 'dense':
    return causal_mask(attn_mask_BxL, segment_ids_BxL, shared_prefix)
  masks = {'attn': attn_mask_BxL}
  if segment_ids_BxL is not None:
    masks['segments'] = segment_ids_BxL
    if shared_prefix:
      masks['prefix'] = segment_ids_BxL == 0
  return masks
