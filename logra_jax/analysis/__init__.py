"""Analysis around the method: a tiny sketched LM for tests and demos, fidelity and cost studies.

Kept out of `logra_jax.sketch` (the method itself): these modules time, plot and compare.
"""
