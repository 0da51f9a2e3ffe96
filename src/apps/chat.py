"""The chat REPL: a conversation with a trained model in the terminal.

`ChatSession` holds one conversation (`src.inference.generate.Context`),
streams each reply as `generate` writes it, and runs the REPL's /commands
(settings, save and load in the training-data format). `run_repl` reads
messages and commands until /quit or end of input; Ctrl-C stops a reply.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from src.core.errors import UserError
from src.core.signals import StopSignals
from src.data import chatformat
from src.inference import engine, sampling
from src.inference.decoding import Decoder
from src.inference.generate import LEAD, Context, Turn

HELP = """commands:
  /help              this list
  /reset             start a new conversation
  /show              settings and how much of the context is used
  /set NAME VALUE    change a setting, e.g. /set temperature 0.7
  /save FILE         write the conversation in the training-data format
  /load FILE         start from a conversation file (training-data format)
  /quit              leave (Ctrl-D works too)
Ctrl-C stops a reply; Ctrl-D leaves."""


# /load reads at most this much: far more text than a context holds.
MAX_LOAD_BYTES = 8 * 1024 * 1024


class ChatSession:
  """One conversation with a `Decoder`."""

  def __init__(
    self,
    decoder: Decoder,
    settings: sampling.SamplingSettings,
    out=None,
  ):
    self.decoder = decoder
    self.tok = decoder.tokenizer
    self.markers = self.tok.markers
    self.settings = settings
    self.out = out or sys.stdout
    self.context = Context(decoder, say=self._say)
    self.rng = np.random.default_rng(settings.seed)
    # Ctrl-C stops a reply between tokens (see src.core.signals).
    self.flag = StopSignals(('SIGINT',), second_sigint_raises=False)
    # Piped mode: each reply on exactly one line, its line breaks shown
    # as the line-break marker (` |br| `), so a script reads one line per
    # message it sent.
    self.one_line = False
    self.check_settings()

  def check_settings(self):
    """Settings that need the model: a reply must fit in the context."""
    most = self.decoder.max_len // 2
    if self.settings.max_new_tokens > most:
      raise UserError(
        f'max_new_tokens {self.settings.max_new_tokens} is more than half '
        f'the context ({self.decoder.max_len} tokens); use at most {most}'
      )

  # ---- conversation state

  @property
  def turns(self) -> list[Turn]:
    return self.context.turns

  @turns.setter
  def turns(self, turns: list[Turn]):
    self.context.turns = turns

  def reset(self):
    self.context.reset()
    self.rng = np.random.default_rng(self.settings.seed)

  def used(self) -> int:
    return self.context.used()

  def _say(self, text: str):
    self.out.write(text + '\n')
    self.out.flush()

  def recover(self):
    """Rebuilds the context from the finished turns after a reply or a
    command was cut short (Ctrl-C while feeding, an error), with Ctrl-C
    held off meanwhile (`Context.recover`)."""
    with self.flag.armed():
      self.context.recover()

  # ---- replying

  def reply(self, text: str, stream: bool = True) -> str | None:
    """Adds a user turn, generates and returns the AI's reply.

    The reply is written to `out` as it is generated; line-break markers are
    shown as line breaks. Returns None for an empty message.
    """
    s = self.settings
    logits = self.context.ask(text, s.max_new_tokens)
    if logits is None:
      return None

    def show(piece: str):
      self.out.write(piece)
      self.out.flush()

    with self.flag.armed() as flag:
      reply = engine.stream_reply(
        self.context,
        logits,
        s,
        self.rng,
        stop=lambda: flag.stop,
        emit=show if stream else None,
        one_line=self.one_line,
      )
    if stream:
      self.out.write(' [stopped]\n' if reply.cancelled else '\n')
      self.out.flush()
    return reply.text

  # ---- files

  def conversation(self) -> chatformat.Conversation:
    """The session as training data: empty replies are left out (the user
    messages around one are joined with the line-break marker) and a last
    unanswered user message is dropped, so the file always parses."""
    merged: list[list] = []
    for t in self.turns:
      if not t.text.replace(self.markers.line_break, '').strip():
        continue
      if merged and merged[-1][0] == t.role:
        merged[-1][1] += f' {self.markers.line_break} {t.text}'
      else:
        merged.append([t.role, t.text])
    while merged and merged[-1][0] != chatformat.AI:
      merged.pop()
    return chatformat.Conversation(
      tuple(chatformat.Turn(role, text, '', 0) for role, text in merged)
    )

  def save(self, path: str):
    if not self.conversation().turns:
      raise UserError('nothing to save yet: no reply in this conversation')
    if os.path.exists(path):
      raise UserError(f'{path} exists; choose another file name')
    text = chatformat.format_conversation(self.conversation(), self.markers)
    try:
      with open(path, 'x', encoding='utf-8') as f:
        f.write(text)
    except OSError as e:
      raise UserError(
        f'{path}: cannot write it ({e.strerror}); choose a file in a folder '
        'that exists'
      ) from None
    self._say(f'(saved {len(self.turns)} turns to {path})')

  def load(self, path: str):
    if not os.path.isfile(path):
      raise UserError(f'{path}: no such file')
    size = os.path.getsize(path)
    if size > MAX_LOAD_BYTES:
      raise UserError(
        f'{path}: {size / 2**20:.0f} MB; /load reads at most '
        f'{MAX_LOAD_BYTES >> 20} MB (the context keeps only its last '
        f'{self.decoder.max_len} tokens): load the end of the conversation'
      )
    try:
      convs = chatformat.read_file(path, markers=self.markers)
    except OSError as e:
      raise UserError(f'{path}: cannot read it ({e.strerror})') from None
    turns = []
    for turn in chatformat.iter_turns(convs):
      ids = self.tok.encode_turn(turn)
      turns.append(Turn(turn.role, turn.text, ids))
    self.reset()
    budget = self.decoder.max_len - self.settings.max_new_tokens - 64
    budget -= LEAD
    while turns and sum(len(t.ids) for t in turns) > budget:
      turns.pop(0)
    self.context.reread(turns)
    ids = self.context.ids()
    self._say(f'(loaded {len(turns)} turns, {len(ids)} tokens, from {path})')

  # ---- commands

  def show(self) -> str:
    s = dataclasses.asdict(self.settings)
    settings = ', '.join(f'{k}={v}' for k, v in s.items())
    return (
      f'settings: {settings}\ncontext: {self.used()} of '
      f'{self.decoder.max_len} tokens used, {len(self.turns)} turns'
    )

  def command(self, line: str) -> bool:
    """Runs a /command. Returns False when the session should end."""
    parts = line.strip().split()
    name, args = parts[0].lower(), parts[1:]
    if name in ('/quit', '/exit', '/q'):
      return False
    if name == '/help':
      self._say(HELP)
    elif name == '/reset':
      self.reset()
      self._say('(new conversation)')
    elif name == '/show':
      self._say(self.show())
    elif name == '/set':
      if len(args) != 2:
        raise UserError('usage: /set NAME VALUE (see /show for the names)')
      old = dataclasses.replace(self.settings)
      self.settings.set(args[0], args[1])
      try:
        self.check_settings()
      except UserError:
        self.settings = old
        raise
      if args[0].replace('-', '_') == 'seed':
        self.rng = np.random.default_rng(self.settings.seed)
      self._say(f'({args[0]} = {args[1]})')
    elif name in ('/save', '/load'):
      if len(args) != 1:
        raise UserError(f'usage: {name} FILE')
      (self.save if name == '/save' else self.load)(args[0])
    else:
      raise UserError(f'unknown command {name}; /help lists the commands')
    return True


CONTINUE = '\\'  # A line ending in a backslash continues on the next.


def read_message(interactive: bool, stdin) -> str | None:
  """One message: a line, or several joined where a line ends in a
  backslash (the backslash is dropped, the line break kept). None at the
  end of input; EOFError/KeyboardInterrupt pass through from input()."""
  lines = []
  while True:
    if interactive:
      line = input('...> ' if lines else 'you> ')
    else:
      line = stdin.readline()
      if line == '':
        return '\n'.join(lines) if lines else None
    line = line.rstrip('\r\n')
    if line.endswith(CONTINUE):
      lines.append(line[: -len(CONTINUE)])
      continue
    lines.append(line)
    return '\n'.join(lines)


def run_repl(session: ChatSession, interactive: bool, stdin=None):
  """Reads user turns and commands until /quit or end of input.

  Args:
    session: The chat session.
    interactive: A terminal: prompts, line editing and history.
    stdin: Input stream when not interactive (default sys.stdin); each
      reply is then printed on one line (`ChatSession.one_line`).
  """
  stdin = stdin or sys.stdin
  session.one_line = not interactive
  if interactive:
    _enable_line_editing()
    d = session.decoder
    session._say(
      f'Jade V8: model at step {d.step}, context {d.max_len} tokens. '
      'Type a message (end a line with \\ to go on to the next); /help '
      'lists commands, Ctrl-D leaves.'
    )
    if d.curves:
      session._say(f'(how it trained: {d.curves})')
  while True:
    try:
      line = read_message(interactive, stdin)
    except EOFError:
      break
    except KeyboardInterrupt:
      session.out.write('\n')
      continue
    if line is None:
      break
    line = line.strip()
    if not line:
      continue
    try:
      if line.startswith('/'):
        if not session.command(line):
          break
        continue
      if interactive:
        session.out.write('jade> ')
        session.out.flush()
      session.reply(line)
    except UserError as e:
      session._say(f'error: {e}')
      session.recover()
    except KeyboardInterrupt:
      session._say('\n(interrupted: the context is read again)')
      session.recover()
  if interactive:
    session.out.write('\n')


def _enable_line_editing():
  try:
    import readline  # noqa: F401  (line editing and history for input())
  except ImportError:
    return
  history = os.path.expanduser('~/.jade_v8_history')
  try:
    readline.read_history_file(history)
  except OSError:
    pass
  import atexit

  def save():
    try:
      readline.write_history_file(history)
    except OSError:
      pass

  atexit.register(save)
