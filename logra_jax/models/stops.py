"""The full set of token ids that end a completion: EOS ids and the chat end-of-turn token.

A chat model often ends its turns with a token that is not the tokenizer's `eos_token`
(Qwen2.5 base tokenizers: eos `<|endoftext|>`, turns end with `<|im_end|>`; Llama 3: eos
`<|end_of_text|>`, turns end with `<|eot_id|>`), and its generation_config.json may list
several EOS ids. Stopping on `tokenizer.eos_token_id` alone then generates to max_new_tokens
every time.

    stops = stop_token_ids(tokenizer, model.config.eos_token_ids)
"""
from typing import Any, Optional, Sequence

_PROBE = 'LOGRA_END_OF_TURN_PROBE'


def _special_ids(tokenizer) -> set:
  ids = set(getattr(tokenizer, 'all_special_ids', ()) or ())
  added = getattr(tokenizer, 'added_tokens_decoder', None) or {}
  return ids | {i for i, tok in added.items() if getattr(tok, 'special', False)}


def end_of_turn_token_id(tokenizer) -> Optional[int]:
  """The special token the chat template writes right after an assistant message, or None.

  Renders [user, assistant: a probe string] and tokenises what follows the probe; the first
  token counts only if it is a special (added) token, so a template that ends turns with
  plain text (a newline) gives None.
  """
  if not getattr(tokenizer, 'chat_template', None):
    return None
  import jinja2  # pylint: disable=g-import-not-at-top  (what chat templates need anyway)
  messages = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': _PROBE}]
  try:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
  except (jinja2.TemplateError, ValueError, KeyError, TypeError):
    return None  # a template that cannot render this conversation names no end of turn
  if not isinstance(text, str) or _PROBE not in text:
    return None
  tail = text[text.rindex(_PROBE) + len(_PROBE):]
  ids = tokenizer(tail, add_special_tokens=False)['input_ids'] if tail else []
  return int(ids[0]) if ids and ids[0] in _special_ids(tokenizer) else None


def stop_token_ids(tokenizer: Any = None, eos_token_ids: Sequence[int] = ()) -> tuple:
  """The model's stop set, in order, without repeats.

  Args:
    tokenizer: an HF tokenizer (its `eos_token_id` and chat template's end-of-turn token), a
      tokenizer with an `eos_id` (the tiny task's), or None.
    eos_token_ids: the model's EOS ids (`ModelConfig.eos_token_ids`: config.json's and
      generation_config.json's `eos_token_id`, or the GGUF's eos / eot ids).
  """
  ids = []
  if tokenizer is not None:
    ids.append(getattr(tokenizer, 'eos_token_id', getattr(tokenizer, 'eos_id', None)))
  ids += list(eos_token_ids)
  if tokenizer is not None:
    ids.append(end_of_turn_token_id(tokenizer))
  return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
