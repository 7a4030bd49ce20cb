"""Comparisons against references, shared by the numerics tests."""
import jax
import numpy as np


def close(actual, expected, rtol):
  """|actual − expected| <= rtol · max|expected| (an entry of a sum carries the rounding of
  its largest terms, so the bound is relative to the array's largest entry)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  scale = max(float(np.max(np.abs(expected))), 1e-300)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def close_trees(a, b, rtol):
  """`close` leaf by leaf; the trees' structures must match."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    close(x, y, rtol)
