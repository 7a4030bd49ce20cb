"""A weight fingerprint both sides compute without exchanging vectors (docs/bridge.md).

Per tensor W (HF name and layout, viewed as (d_out, d_in); a 1-D tensor as (1, d)):

    fp(W) = [‖W‖_F, r_1ᵀ W c_1, …, r_Kᵀ W c_K]

with r_k ∈ {±1}^d_out and c_k ∈ {±1}^d_in read from SHAKE-256 of ``"{name}|{k}|r"`` and
``"{name}|{k}|c"`` (standard library: every process derives the same signs from the name).
r ⊗ c is a ±1 vector over the whole tensor, so E[(rᵀ E c)²] = ‖E‖_F²: the difference of two
fingerprints estimates the relative distance of the weights,

    drift(W_a, W_b) = max(|‖W_a‖ − ‖W_b‖|, sqrt(mean_k (fp_k(W_a) − fp_k(W_b))²)) / ‖W_a‖,

and one perturbed element δ moves each r_kᵀ W c_k by ±δ. K + 1 float64 numbers per tensor:
at K = 4, 40 bytes a tensor, 10.9 KB for SmolLM2-135M's 272 tensors.

numpy and the standard library only: vLLM's plug-in loads this file by path (`refs.py`).
"""
import hashlib
import math
from typing import Mapping

import numpy as np

K = 4  # projections per tensor
# Relative drift tolerated before a server is re-synced, by the coarser of the trainer's and
# the server's weight dtypes (docs/bridge.md "Drift from the generators"), 5x or more above
# what a faithful server shows times the K = 4 estimate's spread (for a noise-like E, as
# rounding is, its square is ‖E‖²·χ²_4/4, below 4.6x at 99.9 %: the estimate below 2.2x the
# true drift). fp32: low-rank applies in fp32 in another summation order (numpy on vLLM, XLA
# here), ~1e-7 relative per step, a random walk over 10^4 steps without an anchor ~1e-5 (x2.2:
# 2.2e-5). bf16 / fp16 serving: every weight rounded, unit roundoff 2^-8 / 2^-11, ~1.6e-3 /
# 2e-4 relative RMS (x2.2: 3.5e-3 / 4.4e-4). A bf16 trainer with stochastic rounding
# random-walks away from an fp32 server by up to one bf16 ulp per step: past 2e-2 after ~100
# steps, when the re-sync is an anchor.
TOLERANCE = {'float32': 1e-4, 'float16': 5e-3, 'bfloat16': 2e-2}


def signs(name: str, k: int, side: str, n: int) -> np.ndarray:
  """The ±1 float64 vector of length ``n`` for tensor ``name``, projection ``k``, ``side``
  'r' (rows) or 'c' (columns): bit i of SHAKE-256("{name}|{k}|{side}") → 1 − 2·bit."""
  digest = hashlib.shake_256(f'{name}|{k}|{side}'.encode()).digest((n + 7) // 8)
  bits = np.unpackbits(np.frombuffer(digest, np.uint8))[:n]
  return 1.0 - 2.0 * bits.astype(np.float64)


def as_matrix_shape(shape) -> tuple:
  """(d_out, d_in) a tensor of ``shape`` is viewed as: 1-D (d,) → (1, d)."""
  shape = tuple(shape)
  if len(shape) == 1:
    return (1, shape[0])
  return (shape[0], math.prod(shape[1:]))


def sign_vectors(name: str, shape, k: int = K) -> tuple:
  """(R (k, d_out), C (k, d_in)) float64 sign vectors of tensor ``name``."""
  d_out, d_in = as_matrix_shape(shape)
  rows = np.stack([signs(name, i, 'r', d_out) for i in range(k)])
  cols = np.stack([signs(name, i, 'c', d_in) for i in range(k)])
  return rows, cols


def tensor_fingerprint(name: str, w, k: int = K) -> list:
  """[‖W‖_F, r_1ᵀ W c_1, …, r_kᵀ W c_k] of one tensor in float64 (numpy)."""
  w = np.asarray(w, np.float64).reshape(as_matrix_shape(np.shape(w)))
  rows, cols = sign_vectors(name, w.shape, k)
  projections = np.einsum('ki,ki->k', rows, cols @ w.T)
  return [float(np.linalg.norm(w))] + [float(p) for p in projections]


def fingerprint(tensors: Mapping[str, np.ndarray], k: int = K) -> dict:
  """{name: tensor_fingerprint} of every tensor."""
  return {name: tensor_fingerprint(name, w, k) for name, w in tensors.items()}


def tensor_drift(reference, other) -> float:
  """The relative distance two fingerprints of one tensor estimate (module docstring)."""
  ref, got = np.asarray(reference, np.float64), np.asarray(other, np.float64)
  if ref.shape != got.shape or not np.all(np.isfinite(got)):
    return math.inf
  rms = math.sqrt(float(np.mean((ref[1:] - got[1:]) ** 2)))
  return max(abs(ref[0] - got[0]), rms) / max(ref[0], 1e-30)


def drift(reference: Mapping[str, list], other: Mapping[str, list]) -> tuple:
  """(max relative drift over the tensors, the worst tensor's name); a tensor missing from
  either side (or extra) is infinitely far."""
  worst, name = 0.0, ''
  for n in sorted(set(reference) | set(other)):
    d = tensor_drift(reference[n], other[n]) if n in reference and n in other else math.inf
    if d > worst or not name:
      worst, name = d, n
  return worst, name


def tolerance(*dtypes: str) -> float:
  """The tolerance for the coarsest of ``dtypes`` (numpy names: 'float32', 'bfloat16' …)."""
  return max(TOLERANCE.get(str(d), TOLERANCE['bfloat16']) for d in dtypes)
