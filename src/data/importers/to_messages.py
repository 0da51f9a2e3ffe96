"""The exporter back: line-format conversations to messages JSONL."""

from __future__ import annotations

import json
import os

from src.core.errors import UserError
from src.data import chatformat
from src.data.importers.base import AI, Report


def to_messages(data: str, out_path: str, markers=None) -> Report:
  """Exports conversations in the line format to messages JSONL."""
  markers = markers or chatformat.Markers()
  if os.path.exists(out_path):
    raise UserError(f'{out_path} exists; choose another file name')
  convs = chatformat.read_data(data, markers=markers, repeat_limit=0)
  report = Report()
  with open(out_path, 'x', encoding='utf-8') as f:
    for conv in convs:
      messages = []
      for t in conv.turns:
        message = {
          'role': 'assistant' if t.role == AI else 'user',
          'content': t.text.replace(f' {markers.line_break} ', '\n'),
        }
        if not t.train:
          message['weight'] = 0
          report.context_only += 1
        messages.append(message)
      f.write(json.dumps({'messages': messages}, ensure_ascii=False) + '\n')
      report.conversations += 1
      report.turns += len(messages)
      report.characters += sum(len(m['content']) for m in messages)
  return report
