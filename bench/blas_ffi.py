"""The chunked attention's batched products run by OpenBLAS (numpy's BLAS)
through an XLA FFI call made from Python: an experiment of issue 54, kept
in bench/ because it did not make a training step faster (BENCHMARKS.md
"The chunk products through OpenBLAS from an FFI call").

XLA's CPU backend runs a batched product as one small product after
another on one thread: the attention's chunk products (`[64, 64] x [64,
128]` and back, thousands a layer) run at ~13-18 GFLOP/s on a Zen 3 where
OpenBLAS runs the same shapes at ~45 a core. `matmul(a, b, form)` hands the
whole batch to one FFI handler that splits it over the cores, each part one
`numpy.matmul` with one OpenBLAS thread; nothing is copied (the handler
reads and writes XLA's own buffers). Its gradient is the same products
(`custom_vjp`). `attend` is Trax's `efficient_attention.attend` with its two
products swapped for `matmul`.

The handler is Python called through `ctypes` (the XLA FFI C ABI of
jaxlib's `xla/ffi/api/c_api.h`, API 0.3); no compiled extension is needed.
An error inside it is returned to XLA as an error, never a wrong result.
"""

from __future__ import annotations

import ctypes as C
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

FORMS = ('nn', 'nt', 'tn')  # Which operand is read transposed.
THREADS = 0  # Parts a batch is split into; 0: one a core.
_NAME = 'jade_batched_matmul_'
_F32 = 11  # XLA_FFI_DataType_F32.
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE.
_METADATA = 1  # XLA_FFI_Extension_Metadata.
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL.
_API_VERSION = (0, 3)  # XLA_FFI_API_MAJOR, _MINOR of jaxlib's header.


class _Ext(C.Structure):
  pass


_Ext._fields_ = [
  ('struct_size', C.c_size_t),
  ('type', C.c_int),
  ('next', C.POINTER(_Ext)),
]


class _Version(C.Structure):
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('ext', C.c_void_p),
    ('major', C.c_int),
    ('minor', C.c_int),
  ]


class _Metadata(C.Structure):
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('api_version', _Version),
    ('traits', C.c_uint32),
    ('state_type_id', C.c_int64),
  ]


class _MetadataExt(C.Structure):
  _fields_ = [('base', _Ext), ('metadata', C.POINTER(_Metadata))]


class _Buffer(C.Structure):
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('ext', C.c_void_p),
    ('dtype', C.c_int),
    ('data', C.c_void_p),
    ('rank', C.c_int64),
    ('dims', C.POINTER(C.c_int64)),
  ]


class _List(C.Structure):  # XLA_FFI_Args and XLA_FFI_Rets.
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('ext', C.c_void_p),
    ('size', C.c_int64),
    ('types', C.c_void_p),
    ('items', C.POINTER(C.POINTER(_Buffer))),
  ]


class _Attrs(C.Structure):
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('ext', C.c_void_p),
    ('size', C.c_int64),
    ('types', C.c_void_p),
    ('names', C.c_void_p),
    ('attrs', C.c_void_p),
  ]


class _Frame(C.Structure):  # XLA_FFI_CallFrame.
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('ext', C.POINTER(_Ext)),
    ('api', C.c_void_p),
    ('ctx', C.c_void_p),
    ('stage', C.c_int),
    ('args', _List),
    ('rets', _List),
    ('attrs', _Attrs),
    ('future', C.c_void_p),
  ]


class _ErrorArgs(C.Structure):  # XLA_FFI_Error_Create_Args.
  _fields_ = [
    ('struct_size', C.c_size_t),
    ('ext', C.c_void_p),
    ('message', C.c_char_p),
    ('errc', C.c_int),
  ]


_ERROR_CREATE = C.CFUNCTYPE(C.c_void_p, C.POINTER(_ErrorArgs))
# XLA_FFI_Api: struct_size, extension_start, api_version, internal_api,
# then XLA_FFI_Error_Create.
_ERROR_CREATE_AT = 2 * C.sizeof(C.c_void_p) + C.sizeof(_Version) + 8
_HANDLER = C.CFUNCTYPE(C.c_void_p, C.POINTER(_Frame))


def _array(buffer) -> np.ndarray:
  """XLA's buffer as a numpy array over the same memory (no copy), its
  leading dimensions merged into one batch."""
  b = buffer.contents
  if b.dtype != _F32:
    raise TypeError(f'float32 expected, got XLA dtype {b.dtype}')
  shape = [int(b.dims[i]) for i in range(b.rank)]
  size = int(np.prod(shape))
  flat = np.ctypeslib.as_array((C.c_float * size).from_address(b.data))
  return flat.reshape([-1, *shape[-2:]])


def _operands(a, b, form: str):
  """`a` and `b` as `form` reads them (numpy or JAX arrays alike)."""
  return (
    a.swapaxes(-1, -2) if form[0] == 't' else a,
    b.swapaxes(-1, -2) if form[1] == 't' else b,
  )


class _Pool:
  """Threads that each run one part of the batch (numpy releases the
  GIL in its products, so the parts run at once)."""

  def __init__(self, n: int):
    from concurrent.futures import ThreadPoolExecutor

    self.n = n
    self.pool = ThreadPoolExecutor(n, 'jade-kernels') if n > 1 else None

  def run(self, a, b, out, form: str):
    a, b = _operands(a, b, form)
    parts = min(self.n, len(out))
    if parts < 2:
      np.matmul(a, b, out=out)
      return
    cuts = np.linspace(0, len(out), parts + 1).astype(int)
    jobs = [
      self.pool.submit(np.matmul, a[i:j], b[i:j], out=out[i:j])
      for i, j in zip(cuts[:-1], cuts[1:])
    ]
    for job in jobs:
      job.result()


def _error(api: int, message: str):
  """An XLA_FFI_Error made by XLA's own `XLA_FFI_Error_Create`."""
  create = _ERROR_CREATE(C.c_void_p.from_address(api + _ERROR_CREATE_AT).value)
  args = _ErrorArgs(
    C.sizeof(_ErrorArgs), None, message.encode()[:500], _INTERNAL
  )
  return create(C.byref(args))


def _handler(form: str, pool_of):
  def handle(frame_p):
    frame = frame_p.contents
    try:
      if frame.ext and frame.ext.contents.type == _METADATA:
        meta = C.cast(frame.ext, C.POINTER(_MetadataExt)).contents
        data = meta.metadata.contents
        data.api_version.struct_size = C.sizeof(_Version)
        data.api_version.major, data.api_version.minor = _API_VERSION
        data.traits = 0
        return None
      if frame.stage != _EXECUTE:
        return None
      a = _array(frame.args.items[0])
      b = _array(frame.args.items[1])
      out = _array(frame.rets.items[0])
      pool_of().run(a, b, out, form)
      return None
    except Exception as e:  # Becomes the step's error, never a wrong result.
      return _error(frame.api, f'jade batched matmul ({form}): {e!r}')

  return _HANDLER(handle)


_LOCK = threading.Lock()
_STATE: dict = {}


def _pool() -> _Pool:
  with _LOCK:
    if 'pool' not in _STATE:
      _STATE['pool'] = _Pool(THREADS or len(os.sched_getaffinity(0)))
      try:  # One BLAS thread a part: OpenBLAS's own threads lose here.
        from threadpoolctl import threadpool_limits

        _STATE['blas'] = threadpool_limits(1, user_api='blas')
      except ImportError:
        pass
    return _STATE['pool']


def _register():
  with _LOCK:
    if 'handlers' not in _STATE:
      handlers = {f: _handler(f, _pool) for f in FORMS}
      for form, handler in handlers.items():
        capsule = jax.ffi.pycapsule(handler)
        jax.ffi.register_ffi_target(_NAME + form, capsule, platform='cpu')
      _STATE['handlers'] = handlers  # Kept alive as long as the process.


def enabled() -> bool:
  """Whether `matmul` runs through OpenBLAS (the CPU backend); registers
  the handlers the first time."""
  if jax.default_backend() != 'cpu':
    return False
  _register()
  return True


def _shape(a, b, form: str):
  m = a.shape[-1] if form[0] == 't' else a.shape[-2]
  n = b.shape[-2] if form[1] == 't' else b.shape[-1]
  return jax.ShapeDtypeStruct((*a.shape[:-2], m, n), a.dtype)


def _call(a, b, form: str):
  call = jax.ffi.ffi_call(
    _NAME + form, _shape(a, b, form), vmap_method='broadcast_all'
  )
  return call(a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(a, b, form):
  return _call(a, b, form)


def _forward(a, b, form):
  return _call(a, b, form), (a, b)


def _backward(form, saved, g):
  a, b = saved
  if form == 'nn':  # c = a b
    return _call(g, b, 'nt'), _call(a, g, 'tn')
  if form == 'nt':  # c = a b^T
    return _call(g, b, 'nn'), _call(g, a, 'tn')
  return _call(b, g, 'nt'), _call(a, g, 'nn')  # c = a^T b


_product.defvjp(_forward, _backward)


def _reference(a, b, form: str):
  return jnp.matmul(*_operands(a, b, form))


def matmul(a, b, form: str = 'nn'):
  """`a @ b` over leading batch dimensions (the same on both), with `a`
  (`form` 'tn') or `b` ('nt') read transposed in its last two axes."""
  if form not in FORMS:
    raise ValueError(f'form must be one of {FORMS}, got {form!r}')
  same = a.shape[:-2] == b.shape[:-2] and a.ndim >= 3
  fast = a.dtype == b.dtype == jnp.float32 and same
  if not (fast and enabled()):
    return _reference(a, b, form)
  return _product(a, b, form)


def attend(
  q, k=None, v=None, q_chunk_len=None, kv_chunk_len=None, n_chunks_before=0,
  n_chunks_after=0, mask_fn=None, q_info=None, kv_info=None, dropout=0.0,
  rng=None,
):  # fmt: skip
  """Trax 1.4.1's `efficient_attention.attend` (same arguments, same
  `(output, dots_logsumexp)`), its two products through `matmul`."""
  from trax import fastmath
  from trax.layers.research import efficient_attention as ea

  if v is None:
    raise ValueError('attend needs values')
  share_qk = k is None
  # Positions are 1-indexed inside so that position 0 can be masked too.
  if q_info is None:
    q_info = jnp.arange(1, q.shape[-2] + 1, dtype=jnp.int32)
  else:
    q_info += 1
  if kv_info is None and not share_qk:
    kv_info = jnp.arange(1, v.shape[-2] + 1, dtype=jnp.int32)
  elif kv_info is not None:
    kv_info += 1
  if q_chunk_len is not None:
    q = jnp.reshape(q, (-1, q_chunk_len, q.shape[-1]))
    q_info = jnp.reshape(q_info, (-1, q_chunk_len))
  if share_qk:
    k, kv_chunk_len = q, q_chunk_len
    if kv_info is None:
      kv_info = q_info
    elif kv_chunk_len is not None:
      kv_info = jnp.reshape(kv_info, (-1, kv_chunk_len))
  elif kv_chunk_len is not None:
    k = jnp.reshape(k, (-1, kv_chunk_len, k.shape[-1]))
    kv_info = jnp.reshape(kv_info, (-1, kv_chunk_len))
  if kv_chunk_len is not None:
    v = jnp.reshape(v, (-1, kv_chunk_len, v.shape[-1]))
  if share_qk:
    k = ea.length_normalized(k)
  k = k / jnp.sqrt(k.shape[-1])
  k = ea.look_adjacent(k, n_chunks_before, n_chunks_after)
  v = ea.look_adjacent(v, n_chunks_before, n_chunks_after)
  kv_info = ea.look_adjacent(kv_info, n_chunks_before, n_chunks_after)
  dots = matmul(q, k, 'nt')
  if mask_fn is not None:
    dots = mask_fn(dots, q_info[..., :, None], kv_info[..., None, :])
  dots_logsumexp = fastmath.logsumexp(dots, axis=-1, keepdims=True)
  dots = jnp.exp(dots - dots_logsumexp)
  if dropout > 0.0:
    keep_prob = 1.0 - dropout  # Broadcast across the chunks.
    keep = fastmath.random.bernoulli(rng, keep_prob, dots.shape[-2:])
    dots = dots * (keep.astype(dots.dtype) / keep_prob)
  out = matmul(dots, v, 'nn')
  out = jnp.reshape(out, (-1, out.shape[-1]))
  return out, jnp.reshape(dots_logsumexp, (-1,))
