"""Chat exports at size: time and peak memory of converting a big WhatsApp
export and a big Telegram JSON export.

  python bench/chat_import.py [--mb 200] [--work DIR] [--smoke]

Writes a WhatsApp Android export (`DATE, TIME - Name: text`, multi-line
messages, media placeholders, deleted messages, notices) and a Telegram
Desktop full export (`chats.list`, text as strings and entity lists,
service messages, stickers) of about `--mb` MB each, built from a fixed
seed, then runs `python -m src.apps.convert` on each in a child process
and reports its wall time, throughput and peak resident memory (the
child's `ru_maxrss`). For scale, the same is measured for reading the
Telegram file with `json.load` (what a non-streaming importer does first)
and for a child that only starts Python and imports the converter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
  'the a to you I and it is of that in we for on are be was have this '
  'with not but so what can just do at if me my your all no yes ok when '
  'how about get see will now like there one out up time go know think '
  'dinner tomorrow tonight weekend train work home later soon maybe sure '
  'thanks good great haha lol really nice love coffee call meet park '
  'movie rain sun late early morning night week friday saturday'
).split()
PEOPLE = ('Alex Doe', 'Sam Lee', 'Kim Park', 'Jo Rivera')


def _sentence(rng: random.Random) -> str:
  n = rng.randint(2, 16)
  return ' '.join(rng.choice(WORDS) for _ in range(n)).capitalize()


def write_whatsapp(path: str, size: int, seed: int = 0) -> int:
  """An Android export of about `size` bytes; returns its message count."""
  rng = random.Random(seed)
  t = 1_600_000_000
  n = 0
  import datetime

  with open(path, 'w', encoding='utf-8', newline='\r\n') as f:
    f.write(
      '12/09/2020, 14:22 - Messages and calls are end-to-end encrypted. '
      'No one outside of this chat, not even WhatsApp, can read or listen '
      'to them. Tap to learn more.\n'
    )
    while f.tell() < size:
      t += rng.choice((20, 60, 300, 900, 3600, 30000))
      stamp = datetime.datetime.fromtimestamp(t, datetime.UTC)
      who = rng.choice(PEOPLE)
      r = rng.random()
      if r < 0.03:
        text = '<Media omitted>'
      elif r < 0.04:
        text = 'This message was deleted'
      elif r < 0.10:
        text = _sentence(rng) + '\n' + _sentence(rng)
      else:
        text = _sentence(rng)
      f.write(f'{stamp:%d/%m/%Y, %H:%M} - {who}: {text}\n')
      n += 1
  return n


def write_telegram(path: str, size: int, seed: int = 0) -> int:
  """A full Telegram export of about `size` bytes in 8 chats."""
  rng = random.Random(seed)
  n = 0
  per_chat = size // 8
  with open(path, 'w', encoding='utf-8') as f:
    f.write(
      '{"about": "Here is the data you requested.", "chats": {"about"'
      ': "", "list": ['
    )
    for c in range(8):
      start = f.tell()
      f.write(
        ('' if c == 0 else ',')
        + json.dumps({'name': f'Chat {c}', 'type': 'personal_chat', 'id': c})[
          :-1
        ]
        + ', "messages": ['
      )
      t = 1_600_000_000
      first = True
      while f.tell() - start < per_chat:
        t += rng.choice((20, 60, 300, 900, 3600, 30000))
        who = rng.choice(PEOPLE)
        r = rng.random()
        message = {
          'id': n,
          'type': 'message',
          'date': time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(t)),
          'date_unixtime': str(t),
          'from': who,
          'from_id': f'user{PEOPLE.index(who)}',
        }
        if r < 0.02:
          message['type'] = 'service'
          message['action'] = 'pin_message'
        elif r < 0.05:
          message.update(text='', media_type='sticker', sticker_emoji='👍')
        elif r < 0.15:
          message['text'] = [
            _sentence(rng) + ' ',
            {'type': 'bold', 'text': _sentence(rng)},
          ]
        else:
          message['text'] = _sentence(rng)
        message['text_entities'] = []
        f.write(
          ('' if first else ',') + json.dumps(message, ensure_ascii=False)
        )
        first = False
        n += 1
      f.write(']}')
    f.write(']}}')
  return n


def measure(argv: list[str]) -> tuple[float, float, int]:
  """(seconds, peak resident MB, exit status) of a child process."""
  start = time.perf_counter()
  proc = subprocess.Popen(
    argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
  )
  _, status, usage = os.wait4(proc.pid, 0)
  seconds = time.perf_counter() - start
  out = proc.stdout.read().decode(errors='replace')
  proc.stdout.close()
  if status:
    print(out[-2000:])
  elif out.strip():
    print('  ' + out.strip().splitlines()[-1][:300])
  return seconds, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--mb', type=float, default=200.0)
  parser.add_argument('--work', default=None)
  parser.add_argument('--smoke', action='store_true', help='1 MB files')
  args = parser.parse_args(argv)
  size = int((1 if args.smoke else args.mb) * 1024 * 1024)
  work = args.work or tempfile.mkdtemp(prefix='jade-chat-import-')
  os.makedirs(work, exist_ok=True)
  wa = os.path.join(work, 'WhatsApp Chat with Sam Lee.txt')
  tg = os.path.join(work, 'result.json')
  print(f'writing {size / 2**20:.0f} MB exports into {work}')
  n_wa = write_whatsapp(wa, size)
  n_tg = write_telegram(tg, size)
  rows = []
  py = sys.executable
  base = [py, '-c', 'import src.apps.convert']
  rows.append(('python + import of the converter', None, None, *measure(base)))
  for fmt, path, n in (('whatsapp', wa, n_wa), ('telegram', tg, n_tg)):
    out = os.path.join(work, f'out-{fmt}')
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
      py,
      '-m',
      'src.apps.convert',
      fmt,
      path,
      out,
      '--ai',
      'Alex Doe',
      '--trim',
    ]
    rows.append((f'convert {fmt}', os.path.getsize(path), n, *measure(cmd)))
  load = [py, '-c', f'import json; json.load(open({tg!r}, encoding="utf-8"))']
  rows.append(
    (
      'json.load of the Telegram file',
      os.path.getsize(tg),
      n_tg,
      *measure(load),
    )
  )
  print(f'\nPython {sys.version.split()[0]}, {os.cpu_count()} cores\n')
  print('| what | input MB | messages | seconds | MB/s | peak RSS MB |')
  print('|---|---|---|---|---|---|')
  for what, nbytes, n, seconds, peak, status in rows:
    mb = '' if nbytes is None else f'{nbytes / 2**20:.0f}'
    rate = '' if nbytes is None else f'{nbytes / 2**20 / seconds:.1f}'
    print(
      f'| {what} | {mb} | {n or ""} | {seconds:.1f} | {rate} | '
      f'{peak:.0f} |' + ('' if status == 0 else f' exit {status}')
    )
  if not args.work:
    shutil.rmtree(work)
  return 0 if all(r[-1] == 0 for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
