"""The logra generation bridge inside vLLM: weight-transfer engine, worker extension, auth.

Runs in vLLM's virtual environment. It loads two files of the repo by path (numpy only):
`logra_jax/bridge/wire.py` (the `logra-update/1` payload) and `logra_jax/sketch/projection.py`.
"""
