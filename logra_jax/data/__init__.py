"""Prompt data: sources (reasoning-gym, files, the tiny task) and grain pipelines."""
from logra_jax.data.pipeline import eval_dataset
from logra_jax.data.pipeline import prompt_dataset
from logra_jax.data.pipeline import restore_from_json
from logra_jax.data.pipeline import state_to_json
from logra_jax.data.sources import file_source
from logra_jax.data.sources import format_prompt
from logra_jax.data.sources import get_source
from logra_jax.data.sources import read_problems
from logra_jax.data.sources import reasoning_gym_source
from logra_jax.data.sources import SOURCES
from logra_jax.data.sources import tiny_addition_source
from logra_jax.data.sources import with_prompts
from logra_jax.data.tiny_task import addition_split
from logra_jax.data.tiny_task import CharTokenizer
from logra_jax.data.tiny_task import warm_start_batch
