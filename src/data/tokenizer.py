"""The sentencepiece tokenizer: trained on the run's data, saved with the run.

The three markers are user-defined symbols, so each is exactly one id
wherever it appears. Ids 0/1/2 are pad/eos/unk; there is no bos.

Files in out-dir: `tokenizer.model` (sentencepiece) and `tokenizer.json`
(settings and a fingerprint of the data it was trained on). Both are written
to a temporary file first and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re

import numpy as np
import sentencepiece as spm

from src.core import rundir
from src.core.errors import UserError
from src.core.files import damaged, read_json, read_regular, write_atomic
from src.data import chatformat

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
# Token roles (see `Tokenizer.encode_with_roles`): what loss a token gets.
ROLE_OTHER, ROLE_AI, ROLE_AI_CONTEXT = 0, 1, 2
MODEL_FILE, INFO_FILE = rundir.TOKENIZER_MODEL, rundir.TOKENIZER_INFO


def data_fingerprint(conversations) -> str:
  """A hash of the training text (turn roles and texts, in order)."""
  h = hashlib.sha256()
  for turn in chatformat.iter_turns(conversations):
    h.update(turn.role.encode())
    h.update(b'\0')
    h.update(turn.text.encode('utf-8'))
    h.update(b'\n')
  return h.hexdigest()


_CONTROL = re.compile('[\x00-\x08\x0b-\x1f\x7f-\x9f]')


class Tokenizer:
  """Encodes turns to ids and back; wraps a sentencepiece model."""

  def __init__(self, model_proto: bytes, markers: chatformat.Markers):
    self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self.model_proto = model_proto
    self.unsaved = None  # (requested vocab size, data fingerprint) if new.
    self.markers = markers
    self.ai_start_id = self.sp.piece_to_id(markers.ai_start)
    self.ai_end_id = self.sp.piece_to_id(markers.ai_end)
    self.line_break_id = self.sp.piece_to_id(markers.line_break)
    for marker, i in zip(markers.all(), self.marker_ids()):
      if i == UNK_ID:
        raise UserError(
          f'tokenizer: marker {marker!r} is not in the '
          'vocabulary; the tokenizer was trained with other '
          'markers. Use the markers it was trained with or a '
          'new out-dir'
        )

  def marker_ids(self) -> list[int]:
    return [self.ai_start_id, self.ai_end_id, self.line_break_id]

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)

  def decode(self, ids) -> str:
    """The text of `ids`; control characters (a byte-fallback piece can
    make ESC) come out escaped (`\\x1b`), never as terminal commands."""
    text = self.sp.decode([int(i) for i in ids if int(i) != PAD_ID])
    return _CONTROL.sub(lambda m: f'\\x{ord(m.group()):02x}', text)

  def encode_turn(self, turn: chatformat.Turn) -> list[int]:
    """User turn: its text. AI turn: start marker, text, end marker."""
    ids = self.encode(turn.text)
    if turn.role == chatformat.AI:
      return [self.ai_start_id] + ids + [self.ai_end_id]
    return ids

  def encode_conversations(self, conversations) -> np.ndarray:
    """One token stream: every turn in order, EOS after each conversation.

    Returns:
      `[n_tokens] int32`.
    """
    return self.encode_with_roles(conversations)[0]

  def encode_with_roles(self, conversations, num_threads: int = -1):
    """Encodes conversations into one stream, with each token's role.

    A user turn is its text; an AI turn is the start marker, its text and
    the end marker; EOS follows each conversation. Roles: `ROLE_OTHER` for
    user text, AI start markers and EOS; `ROLE_AI` for the text and end
    marker of an AI turn; `ROLE_AI_CONTEXT` for those of a `|noloss|` turn.

    Returns:
      `([n] int32 ids, [n] uint8 roles, [n_conversations] int64 lengths)`.
    """
    texts, kinds, per_conv = [], [], []
    for conversation in conversations:
      per_conv.append(len(conversation.turns))
      for turn in conversation.turns:
        texts.append(turn.text)
        if turn.role != chatformat.AI:
          kinds.append(ROLE_OTHER)
        else:
          kinds.append(ROLE_AI if turn.train else ROLE_AI_CONTEXT)
    if not texts:
      return (
        np.zeros([0], np.int32),
        np.zeros([0], np.uint8),
        np.zeros([0], np.int64),
      )
    pieces = self.sp.encode(texts, num_threads=num_threads)
    n_turns = len(pieces)
    lens = np.fromiter(map(len, pieces), np.int64, n_turns)
    flat = np.fromiter(
      itertools.chain.from_iterable(pieces), np.int32, int(lens.sum())
    )
    kinds = np.asarray(kinds, np.uint8)
    is_ai = (kinds != ROLE_OTHER).astype(np.int64)
    per_conv = np.asarray(per_conv, np.int64)
    last_turn = np.cumsum(per_conv) - 1
    out_len = lens + 2 * is_ai
    out_len[last_turn] += 1  # EOS.
    starts = np.cumsum(out_len) - out_len
    ids = np.empty([int(out_len.sum())], np.int32)
    roles = np.zeros(ids.shape, np.uint8)
    turn_of_token = np.repeat(np.arange(n_turns), lens)
    within = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    pos = (starts + is_ai)[turn_of_token] + within
    ids[pos] = flat
    roles[pos] = kinds[turn_of_token]
    ai = np.flatnonzero(is_ai)
    ids[starts[ai]] = self.ai_start_id
    ids[starts[ai] + 1 + lens[ai]] = self.ai_end_id
    roles[starts[ai] + 1 + lens[ai]] = kinds[ai]
    ids[starts[last_turn] + out_len[last_turn] - 1] = EOS_ID
    conv_lengths = np.add.reduceat(out_len, np.cumsum(per_conv) - per_conv)
    return ids, roles, conv_lengths


def train(conversations, vocab_size: int, markers: chatformat.Markers) -> bytes:
  """Trains a unigram sentencepiece model on the turns' texts.

  For big corpora `conversations` is a sample (see `src.data.corpus`); the
  trainer itself also keeps at most 2M sentences, drawn at random.

  Returns:
    The serialized model. The vocabulary may be smaller than `vocab_size`
    when the data has too few distinct pieces.
  """
  turns = list(chatformat.iter_turns(conversations))
  texts = [turn.text for turn in turns]
  out = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_writer=out,
      vocab_size=vocab_size,
      model_type='unigram',
      user_defined_symbols=markers.all(),
      pad_id=PAD_ID,
      eos_id=EOS_ID,
      unk_id=UNK_ID,
      bos_id=-1,
      hard_vocab_limit=False,
      character_coverage=1.0,
      input_sentence_size=2_000_000,
      shuffle_input_sentence=True,
      max_sentence_length=1 << 16,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
    )
  except RuntimeError as e:
    # The trainer skips messages over max_sentence_length bytes; with only
    # those it has nothing to learn from.
    long = [t for t in turns if len(t.text.encode('utf-8')) > 1 << 16]
    if long:
      t = long[0]
      raise UserError(
        f'{t.path}:{t.line}: a message of {len(t.text):,} characters; the '
        f'tokenizer learns only from messages up to 65,536 bytes ({len(long)} '
        'are longer). Split long messages into several lines or with |br|'
      ) from None
    raise UserError(
      f'tokenizer training failed ({e}); lower "vocab-size" or add more data'
    ) from None
  return out.getvalue()


# Bounds on a tokenizer read from a folder: a sentencepiece model of 128k
# pieces is 2.6 MB and takes ~30 MB to load (measured); real vocabularies
# are smaller, and the probe's 2M pieces (45 MB) took 9.8 GB.
MAX_BYTES = 16 * 1024 * 1024
MAX_PIECES = 131_072


def _count_pieces(proto: bytes, stop: int) -> int:
  """How many `pieces` (field 1) a serialized sentencepiece ModelProto
  holds, read from its wire format without parsing it (up to `stop`)."""

  def varint(at):
    value = shift = 0
    while True:
      if at >= len(proto) or shift > 63:
        raise ValueError('truncated')
      byte = proto[at]
      value |= (byte & 0x7F) << shift
      at, shift = at + 1, shift + 7
      if byte < 0x80:
        return value, at

  count = at = 0
  while at < len(proto) and count <= stop:
    key, at = varint(at)
    kind = key & 7
    if kind == 0:
      _, at = varint(at)
    elif kind == 2:
      size, at = varint(at)
      at += size
    elif kind in (1, 5):
      at += 8 if kind == 1 else 4
    else:
      raise ValueError(f'wire type {kind}')
    count += key >> 3 == 1
  if at > len(proto):
    raise ValueError('truncated')
  return count


def _control_piece(sp) -> tuple[int, str] | None:
  """The first piece holding a control character (ESC, ...), if any: text
  from a folder is shown as text, never as terminal commands."""
  for i in range(sp.get_piece_size()):
    piece = sp.id_to_piece(i)
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in piece):
      return i, piece
  return None


def _read_info(info_path: str, required: bool) -> dict:
  """`tokenizer.json`, or a UserError naming what is wrong with it."""
  if not os.path.exists(info_path):
    if required:
      raise UserError(
        f'{info_path}: missing; the run folder is incomplete (copy it '
        'again, or train into a new out-dir)'
      )
    return {}
  info = read_json(info_path)
  try:
    markers = info['markers']
    if not (
      isinstance(markers, list)
      and len(markers) == 3
      and all(isinstance(m, str) and m for m in markers)
    ):
      raise ValueError('markers must be three strings')
  except (OSError, ValueError, KeyError, TypeError) as e:
    fix = 'it must be the JSON this run wrote (copy the run folder again)'
    raise damaged(info_path, e, fix) from None
  return info


def _read_model(model_path: str, markers) -> Tokenizer:
  """`tokenizer.model`, or a UserError if sentencepiece cannot read it."""
  proto = read_regular(model_path, MAX_BYTES)
  try:
    pieces = _count_pieces(proto, MAX_PIECES)
  except ValueError as e:
    raise UserError(
      f'{model_path}: damaged (not a sentencepiece model: {e}); copy the '
      'run folder again, or train into a new out-dir'
    ) from None
  if pieces > MAX_PIECES:
    raise UserError(
      f'{model_path}: more than {MAX_PIECES} pieces, more than a Jade V8 '
      'tokenizer holds; the folder is damaged or not a Jade V8 model'
    )
  try:
    tok = Tokenizer(proto, markers)
  except (RuntimeError, OSError, ValueError, TypeError) as e:
    raise UserError(
      f'{model_path}: damaged (sentencepiece: {" ".join(str(e).split())}); '
      'copy the run folder again, or train into a new out-dir'
    ) from None
  bad = _control_piece(tok.sp)
  if bad is not None:
    raise UserError(
      f'{model_path}: piece {bad[0]} ({bad[1]!r}) holds a control '
      'character, which a terminal may run as a command: the file is not '
      'trustworthy (copy the model folder again from its source), or it '
      'was trained before 2026-12-05 on text holding control characters '
      '(train again into a new out-dir: they now become spaces)'
    )
  return tok


def load_or_train(
  out_dir: str,
  conversations,
  vocab_size: int,
  markers: chatformat.Markers,
  write: bool = True,
  log=print,
  fingerprint: str | None = None,
) -> Tokenizer:
  """Loads the run's tokenizer, or trains and saves one.

  If a tokenizer exists in `out_dir` it is always reused (the checkpoints
  depend on it). If the data has changed since it was trained, this says so;
  if the markers or vocabulary size setting differ, that is an error.

  Args:
    out_dir: The run folder.
    conversations: The parsed training data (or a function returning it).
    vocab_size: Requested vocabulary size.
    markers: The format's markers.
    write: Save a newly trained tokenizer now (else call `save` later).
    log: Where messages go.
    fingerprint: Identifies the training data (default: a hash of the
      conversations' turns); `conversations` may then be a sample of it.
  """
  model_path = os.path.join(out_dir, MODEL_FILE)
  info_path = os.path.join(out_dir, INFO_FILE)
  if fingerprint is None:
    fingerprint = data_fingerprint(conversations)
  if os.path.exists(model_path):
    info = _read_info(info_path, required=False)
    if info.get('markers') and info['markers'] != markers.all():
      raise UserError(
        f'{info_path}: the tokenizer was trained with markers '
        f'{info["markers"]}, the config has {markers.all()}; '
        'restore the markers or use a new out-dir'
      )
    if info.get('requested_vocab_size', vocab_size) != vocab_size:
      raise UserError(
        f'{info_path}: the tokenizer was trained with '
        f'vocab-size {info["requested_vocab_size"]}, the config '
        f'asks for {vocab_size}; set it back or use a new '
        'out-dir'
      )
    if info.get('data_fingerprint', fingerprint) != fingerprint:
      log(
        f'note: the data changed since {model_path} was trained; keeping '
        "that tokenizer because this run's checkpoints use it (use a new "
        'out-dir to train a tokenizer on the new data)'
      )
    return _read_model(model_path, markers)
  if callable(conversations):  # A sample, drawn only when needed.
    conversations = conversations()
  proto = train(conversations, vocab_size, markers)
  tok = Tokenizer(proto, markers)
  tok.unsaved = (vocab_size, fingerprint)
  if write:
    save(out_dir, tok)
  return tok


def save(out_dir: str, tok: Tokenizer):
  """Writes a newly trained tokenizer (no-op for one loaded from disk)."""
  if tok.unsaved is None:
    return
  if isinstance(tok.unsaved, dict):  # Adopted from a pretrained model.
    info = tok.unsaved
  else:
    vocab_size, fingerprint = tok.unsaved
    info = {
      'requested_vocab_size': vocab_size,
      'vocab_size': tok.vocab_size,
      'markers': tok.markers.all(),
      'data_fingerprint': fingerprint,
      'pad_id': PAD_ID,
      'eos_id': EOS_ID,
      'unk_id': UNK_ID,
    }
  write_atomic(os.path.join(out_dir, MODEL_FILE), tok.model_proto)
  write_atomic(
    os.path.join(out_dir, INFO_FILE), json.dumps(info, indent=2).encode()
  )
  tok.unsaved = None


def read_info(model_dir: str) -> dict:
  """A run's or export's `tokenizer.json` (required)."""
  return _read_info(os.path.join(model_dir, INFO_FILE), required=True)


def adopt(tok: Tokenizer, info: dict, source: str) -> Tokenizer:
  """Marks a pretrained model's tokenizer to be saved (`save`) into a new
  fine-tune run, with its info and where it came from."""
  info = {k: v for k, v in info.items() if k != 'data_fingerprint'}
  tok.unsaved = {**info, 'from': source}
  return tok


def load(
  model_dir: str, markers: chatformat.Markers | None = None
) -> Tokenizer:
  """Loads the tokenizer of a finished run (for sampling and evaluation)."""
  model_path = os.path.join(model_dir, MODEL_FILE)
  info_path = os.path.join(model_dir, INFO_FILE)
  if not os.path.exists(model_path):
    raise UserError(
      f'{model_path}: missing; is {model_dir!r} the out-dir of a training run?'
    )
  if markers is None:
    info = _read_info(info_path, required=True)
    markers = chatformat.Markers(*info['markers'])
  return _read_model(model_path, markers)
