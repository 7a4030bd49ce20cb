"""logra_jax: RL post-training of LLMs with LoGRA low-rank gradient sketches."""
