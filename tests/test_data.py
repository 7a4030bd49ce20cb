import json

import numpy as np
import pytest

from logra_jax import data
from logra_jax.data import sources
from logra_jax.rl import rewards


def _questions(batch):
  return [r['question'] for r in batch]


def test_char_tokenizer():
  tok = data.CharTokenizer()
  assert tok.vocab_size <= 32 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  # '1' is id 3 + 1 = 4, '2' -> 5, '+' -> 13, '=' -> 14 (specials take 0-2, digits 3-12).
  assert tok.encode('12+3=', add_bos=True, add_eos=True) == [1, 4, 5, 13, 6, 14, 2]
  assert tok.decode([1, 4, 5, 2, 7, 7]) == '12'  # bos skipped, stops at eos.
  assert tok.decode(tok.encode('98+76=174')) == '98+76=174'
  with pytest.raises(ValueError, match=r"\['x'\]"):
    tok.encode('1x')


def test_tiny_addition_split_is_disjoint_and_reproducible():
  train, heldout = data.get_source('tiny_addition', seed=0, heldout_fraction=0.1)
  # a, b in [10, 99]: 90 * 90 = 8100 problems; 10% = 810 held out.
  assert (len(train), len(heldout)) == (7290, 810)
  assert not {r['question'] for r in train} & {r['question'] for r in heldout}
  assert data.get_source('tiny_addition', seed=0)[1] == heldout
  assert data.get_source('tiny_addition', seed=1)[1] != heldout
  for r in train[:50]:
    a, b = r['question'].rstrip('=').split('+')
    assert int(r['answer']) == int(a) + int(b) and r['verifier'] == 'exact'


def test_warm_start_batch():
  tok = data.CharTokenizer()
  recs = [{'question': '12+34=', 'answer': '46'}, {'question': '1+2=', 'answer': '3'}]
  out = data.warm_start_batch(recs, tok)
  # bos 1 2 + 3 4 = | 4 6 eos -> [1, 4,5,13,6,7,14, 7,9,2]; the second is padded with 0.
  np.testing.assert_array_equal(out['tokens'], [[1, 4, 5, 13, 6, 7, 14, 7, 9, 2],
                                                [1, 4, 13, 5, 14, 6, 2, 0, 0, 0]])
  np.testing.assert_array_equal(out['loss_mask'], [[0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
                                                   [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]])


def test_reasoning_gym_source_keeps_entries():
  train, heldout = data.get_source('reasoning_gym', dataset='basic_arithmetic', size=8, seed=3,
                                   heldout_size=4, max_terms=3)
  assert (len(train), len(heldout)) == (8, 4)  # No chance overlap for this seed.
  assert not {r['question'] for r in train} & {r['question'] for r in heldout}
  r = train[0]
  assert r['reference']['question'] == r['question'] and r['verifier'] == 'reasoning_gym'
  assert r['reference']['metadata']['num_terms'] <= 3
  assert rewards.verify_reasoning_gym(f"<answer>{r['answer']}</answer>", r['reference']) == 1.0


def _write_jsonl(path, rows):
  path.write_text('\n'.join(r if isinstance(r, str) else json.dumps(r) for r in rows) + '\n')


def test_file_source_jsonl_and_parquet(tmp_path):
  rows = [{'problem': f'What is {i}+1?', 'answer': str(i + 1)} for i in range(20)]
  _write_jsonl(tmp_path / 'p.jsonl', rows)
  train, heldout = data.get_source('file', path=str(tmp_path / 'p.jsonl'),
                                   heldout_fraction=0.25, seed=0)
  assert (len(train), len(heldout)) == (15, 5)
  assert not {r['question'] for r in train} & {r['question'] for r in heldout}
  assert train[0]['verifier'] == 'math_verify'
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'p.parquet')
  assert sources.read_problems(str(tmp_path / 'p.parquet'))[3]['answer'] == '4'


def test_file_source_errors_name_file_and_line(tmp_path):
  _write_jsonl(tmp_path / 'bad.jsonl', [{'problem': 'a', 'answer': 1}, '{"problem": oops'])
  with pytest.raises(ValueError, match=r'bad\.jsonl:2: bad JSON'):
    sources.read_jsonl(str(tmp_path / 'bad.jsonl'))
  _write_jsonl(tmp_path / 'miss.jsonl', [{'problem': 'a', 'answer': 1}, {'problem': 'b'}])
  with pytest.raises(ValueError, match=r"miss\.jsonl:2: missing field 'answer'"):
    sources.read_jsonl(str(tmp_path / 'miss.jsonl'))
  with pytest.raises(ValueError, match='unknown prompt source'):
    data.get_source('hub')


def test_format_prompt_chat_template_and_plain():
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  word = tokenizers.Tokenizer(tokenizers.models.WordLevel({'<unk>': 0}, unk_token='<unk>'))
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word)
  tok.chat_template = ('{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}'
                       '{% if add_generation_prompt %}<|assistant|>{% endif %}')
  got = data.format_prompt('1+1?', tok, system_prompt='Be brief.')
  assert got == '<|system|>Be brief.\n<|user|>1+1?\n<|assistant|>'
  assert data.format_prompt('12+34=', data.CharTokenizer()) == '12+34='
  assert data.format_prompt('q', None, system_prompt='s', suffix=' A:') == 's\n\nq A:'
  assert data.with_prompts([{'question': 'q'}])[0]['prompt'] == 'q'


def test_pipeline_resume_reproduces_batches():
  train, _ = data.get_source('tiny_addition')
  recs = train[:50]
  it = iter(data.prompt_dataset(recs, batch_size=8, seed=7))
  for _ in range(3):  # k = 3 batches consumed, then checkpoint.
    next(it)
  saved = data.state_to_json(it)
  expected = [_questions(next(it)) for _ in range(10)]  # Crosses epochs (6 batches/epoch).
  fresh = data.restore_from_json(iter(data.prompt_dataset(recs, batch_size=8, seed=7)), saved)
  assert [_questions(next(fresh)) for _ in range(10)] == expected
  json.loads(saved)  # Plain JSON.


def test_pipeline_epochs_and_seeds():
  recs = [{'question': str(i)} for i in range(10)]
  batches = list(data.prompt_dataset(recs, batch_size=5, seed=0, num_epochs=2))
  # 2 batches per epoch; each epoch is a permutation of all 10 records, reshuffled.
  assert len(batches) == 4
  epoch0, epoch1 = sum(map(_questions, batches[:2]), []), sum(map(_questions, batches[2:]), [])
  assert sorted(epoch0) == sorted(epoch1) == sorted(str(i) for i in range(10))
  assert epoch0 != epoch1
  other = next(iter(data.prompt_dataset(recs, batch_size=5, seed=1)))
  assert _questions(other) != _questions(batches[0])
  evals = list(data.eval_dataset(recs, batch_size=4))
  assert [len(b) for b in evals] == [4, 4, 2]
  assert sum(map(_questions, evals), []) == [str(i) for i in range(10)]
