"""Scalars back from a run's TensorBoard event files, without TensorBoard installed.

An event file (`events.out.tfevents.*`, what `MetricWriter` writes through tensorboardX) is a
sequence of TFRecords: an 8-byte little-endian length, its masked CRC-32C (4 bytes), the
serialized `Event` proto, and the data's masked CRC-32C. Both CRCs are checked.

    scalars = read_scalars('runs/tiny/tensorboard')   # {'reward_mean': [(1, 0.21), ...]}
"""
import glob
import os
import struct

from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path: str):
  """The payloads of the TFRecords in one file; ValueError on a torn or corrupt record."""
  with open(path, 'rb') as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    header = data[pos:pos + 12]
    if len(header) < 12:
      raise ValueError(f'{path}: truncated record header at byte {pos}')
    length, length_crc = struct.unpack('<QI', header)
    if _masked_crc(header[:8]) != length_crc:
      raise ValueError(f'{path}: bad length checksum at byte {pos}')
    payload = data[pos + 12:pos + 12 + length]
    footer = data[pos + 12 + length:pos + 16 + length]
    if len(payload) < length or len(footer) < 4:
      raise ValueError(f'{path}: truncated record at byte {pos}')
    if _masked_crc(payload) != struct.unpack('<I', footer)[0]:
      raise ValueError(f'{path}: bad data checksum in the record at byte {pos}')
    yield payload
    pos += 16 + length


def read_scalars(logdir: str) -> dict:
  """{tag: [(step, value), ...]} from every event file in ``logdir``, sorted by step.

  Values are float32 (TensorBoard stores `simple_value` as a float). Raises ValueError when
  ``logdir`` has no event file or a record is corrupt.
  """
  paths = sorted(glob.glob(os.path.join(logdir, 'events.out.tfevents.*')))
  if not paths:
    raise ValueError(f'no TensorBoard event file (events.out.tfevents.*) in {logdir!r}')
  out = {}
  for path in paths:
    for payload in _records(path):
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        if value.WhichOneof('value') == 'simple_value':
          out.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
  return {tag: sorted(points) for tag, points in out.items()}
