"""The OpenAI chat-completions request, read as untrusted input: every
field typed and bounded (`parse_job`), every refusal an `ApiError` in
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

import dataclasses

from src.core.errors import UserError
from src.data import chatformat
from src.inference import engine, sampling

MAX_MESSAGES = 32768  # A message takes at least one token of the context.
MAX_TOP_LOGPROBS = 20
# Every chat-completions option, and what this server does with it (the
# README's table is this one). An option not listed is refused (400).
DONE = (
  'model',
  'messages',
  'temperature',
  'top_p',
  'max_tokens',
  'max_completion_tokens',
  'n',
  'stop',
  'seed',
  'stream',
  'stream_options',
  'presence_penalty',
  'frequency_penalty',
  'logprobs',
  'top_logprobs',
  'response_format',
  'tools',
  'tool_choice',
  'parallel_tool_calls',
  'functions',
  'function_call',
  'logit_bias',
  'modalities',
  # Not OpenAI's: the sampler's own controls.
  'top_k',
  'repetition_penalty',
)
# About OpenAI's platform, not the reply: accepted and not used.
PLATFORM = (
  'user',
  'metadata',
  'store',
  'service_tier',
  'prompt_cache_key',
  'safety_identifier',
)
# Refused whenever given: this model has nothing to do them with.
REFUSED = {
  'audio': 'the model reads and writes text only',
  'prediction': 'predicted outputs are not supported',
  'web_search_options': 'this server has no web search',
  'reasoning_effort': 'this is not a reasoning model',
  'verbosity': 'the reply length is max_tokens',
}

ROLES = {'user': chatformat.USER, 'assistant': chatformat.AI}
DROPPED_ROLES = ('system', 'developer')


class ApiError(Exception):
  """A request refused with `status` and an OpenAI-shaped error body."""

  def __init__(self, status: int, message: str, param=None, kind=None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or {
      400: 'invalid_request_error',
      401: 'authentication_error',
      404: 'not_found_error',
      503: 'server_busy',
    }.get(status, 'server_error')

  def body(self) -> dict:
    return {
      'error': {
        'message': self.message,
        'type': self.kind,
        'param': self.param,
        'code': None,
      }
    }


@dataclasses.dataclass(kw_only=True)
class Job(engine.Request):
  """One chat-completion request, checked."""

  stream: bool = False
  dropped_system: int = 0


def _number(body: dict, name: str, kind, default):
  value = body.get(name)
  if value is None:
    return default
  ok = (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and abs(value) < 2**53  # A 5000-digit integer is no setting.
  )
  if ok and kind is int:
    ok = float(value).is_integer()
  if not ok:
    shown = repr(value)[:40]
    raise ApiError(400, f'{name} must be a number, not {shown}', name)
  return kind(value)


def _content(message: dict, i: int) -> str:
  content = message.get('content')
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # Content parts: text only.
    texts = []
    for part in content:
      if not (isinstance(part, dict) and part.get('type') == 'text'):
        raise ApiError(
          400, 'only text content parts are supported', f'messages[{i}]'
        )
      texts.append(str(part.get('text', '')))
    return '\n'.join(texts)
  raise ApiError(400, 'content must be a string', f'messages[{i}].content')


def _messages(raw) -> tuple[list[tuple[str, str]], int]:
  """The conversation `(role, content)` in order, and how many system
  messages were dropped; the last one must be the user's."""
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, 'messages must be a non-empty list', 'messages')
  if len(raw) > MAX_MESSAGES:
    raise ApiError(400, f'at most {MAX_MESSAGES} messages', 'messages')
  messages, dropped = [], 0
  for i, m in enumerate(raw):
    if not isinstance(m, dict):
      raise ApiError(400, 'each message must be an object', f'messages[{i}]')
    role = m.get('role')
    if role in DROPPED_ROLES:
      dropped += 1
      continue
    if not isinstance(role, str) or role not in ROLES:
      raise ApiError(
        400,
        f'role {str(role)[:40]!r} is not supported (user, assistant, system)',
        f'messages[{i}].role',
      )
    messages.append((ROLES[role], _content(m, i)))
  if not messages or messages[-1][0] != chatformat.USER:
    raise ApiError(400, 'the last message must be from the user', 'messages')
  return messages, dropped


def _unsupported(body: dict):
  """A 400 naming the first option this server does not do: tools and
  functions (the model was trained on conversations; it has no tool
  format), JSON response formats (it writes chat text; constraining it to
  JSON would give valid but meaningless JSON), a logit bias, other
  modalities, the options in REFUSED, and any unknown name."""
  for name in body:
    if name not in DONE and name not in PLATFORM:
      why = REFUSED.get(name, 'it is not an option this server knows')
      raise ApiError(400, f'{name} is not supported: {why}', name)
  tools = body.get('tools')
  if tools not in (None, []):
    raise ApiError(
      400,
      'tools are not supported: the model has no tool-call format',
      'tools',
    )
  if body.get('functions') not in (None, []):
    raise ApiError(400, 'functions are not supported', 'functions')
  for name in ('tool_choice', 'function_call'):
    if body.get(name) not in (None, 'none', 'auto'):
      raise ApiError(
        400,
        f'{name} {str(body[name])[:40]!r} is not supported: no tools',
        name,
      )
  kind = body.get('response_format')
  if kind is not None and kind != {'type': 'text'}:
    shown = kind.get('type') if isinstance(kind, dict) else kind
    raise ApiError(
      400,
      f'response_format {str(shown)[:40]!r} is not supported: the model '
      'writes chat text, only {"type": "text"}',
      'response_format',
    )
  if body.get('logit_bias') not in (None, {}):
    raise ApiError(400, 'logit_bias is not supported', 'logit_bias')
  if body.get('modalities') not in (None, ['text']):
    raise ApiError(400, 'only the text modality is supported', 'modalities')
  for name in ('parallel_tool_calls', 'store', 'logprobs'):
    if body.get(name) is not None and not isinstance(body[name], bool):
      raise ApiError(400, f'{name} must be true or false', name)
  options = body.get('stream_options')
  if options is not None and not isinstance(options, dict):
    raise ApiError(400, 'stream_options must be an object', 'stream_options')


def _logprobs(body: dict) -> int | None:
  """How many alternatives each token's `logprobs` entry lists, or None
  when `logprobs` is not asked for."""
  top = _number(body, 'top_logprobs', int, None)
  if not body.get('logprobs'):
    if top is not None:
      raise ApiError(400, 'top_logprobs needs "logprobs": true', 'top_logprobs')
    return None
  if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
    raise ApiError(
      400, f'top_logprobs must be 0 to {MAX_TOP_LOGPROBS}', 'top_logprobs'
    )
  return top or 0


def _settings(body: dict, defaults, max_tokens: int, seed):
  """The sampling settings the body asks for (the rest `defaults`)."""
  settings = sampling.SamplingSettings(
    temperature=_number(body, 'temperature', float, defaults.temperature),
    top_p=_number(body, 'top_p', float, defaults.top_p),
    top_k=_number(body, 'top_k', int, defaults.top_k),
    repetition_penalty=_number(
      body, 'repetition_penalty', float, defaults.repetition_penalty
    ),
    repetition_window=defaults.repetition_window,
    presence_penalty=_number(
      body, 'presence_penalty', float, defaults.presence_penalty
    ),
    frequency_penalty=_number(
      body, 'frequency_penalty', float, defaults.frequency_penalty
    ),
    max_new_tokens=max_tokens,
    seed=seed or 0,
  )
  try:
    settings.check()
  except UserError as e:
    named = [n for n in body if isinstance(n, str) and str(e).startswith(n)]
    raise ApiError(400, str(e), named[0] if named else None) from None
  return settings


def _max_tokens(body: dict, max_len: int, defaults) -> int:
  """The reply's length limit: `max_completion_tokens`, else `max_tokens`,
  else the server's; at most half the context."""
  most = max_len // 2
  max_tokens = _number(
    body,
    'max_completion_tokens',
    int,
    _number(body, 'max_tokens', int, min(defaults.max_new_tokens, most)),
  )
  if not 1 <= max_tokens <= most:
    raise ApiError(
      400,
      f'max_tokens must be between 1 and {most} (half the context of '
      f'{max_len} tokens)',
      'max_tokens',
    )
  return max_tokens


def parse_job(
  body, model_id: str, max_len: int, defaults: sampling.SamplingSettings
) -> Job:
  """Checks a chat-completions body (what it leaves out is taken from
  `defaults`, the server's command line); raises `ApiError` (400, 404)."""
  if not isinstance(body, dict):
    raise ApiError(400, 'the body must be a JSON object')
  model = body.get('model', model_id)
  if model != model_id:
    raise ApiError(
      404,
      f'the model {model!r} does not exist; this server serves '
      f'{model_id!r} (GET /v1/models)',
      'model',
      'invalid_request_error',
    )
  _unsupported(body)
  messages, dropped = _messages(body.get('messages'))
  n = _number(body, 'n', int, 1)
  if n != 1:
    raise ApiError(400, 'n must be 1: one reply per request', 'n')
  max_tokens = _max_tokens(body, max_len, defaults)
  seed = body.get('seed')
  if seed is not None and (
    isinstance(seed, bool) or not isinstance(seed, int) or seed < 0
  ):
    raise ApiError(400, 'seed must be a whole number of 0 or more', 'seed')
  settings = _settings(body, defaults, max_tokens, seed)
  stop = body.get('stop')
  stop = [stop] if isinstance(stop, str) else stop or []
  if not (
    isinstance(stop, list)
    and len(stop) <= 4
    and all(isinstance(s, str) and s for s in stop)
  ):
    raise ApiError(400, 'stop must be a string or up to 4 strings', 'stop')
  stream = body.get('stream', False)
  if not isinstance(stream, bool):
    raise ApiError(400, 'stream must be true or false', 'stream')
  return Job(
    messages,
    settings,
    seed,
    stop,
    logprobs=_logprobs(body),
    stream=stream,
    dropped_system=dropped,
  )
