"""Several processes, one run: JAX's distributed runtime, for multi-host.

A TPU pod slice, a multi-node GPU box or two machines by hand run the same
`train.py` once per host. `start(settings)` joins them through
`jax.distributed.initialize` (before JAX touches a device); from then on
`jax.pmap` spans every device of every process, and the gradient all-reduce
in Trax's trainer sums over all of them (on CPU through gloo, on GPU NCCL, on
TPU the interconnect).

Who does what (see `src.training.trainer`):
- Process 0, the chief, does everything a single process does: checks the
  out-dir, trains or loads the tokenizer, writes the token cache,
  checkpoints, TensorBoard events. It then sends the others what they need
  to start the same run (`Cluster.broadcast_json`): the tokenizer, the step
  it resumes from, the pretrained model's settings of a fine-tune.
- Every other process writes nothing to out-dir. It tokenizes its own copy
  of the data (same path on every host) with the chief's tokenizer into a
  private temporary folder, and receives the chief's weights, state and
  optimizer slots before the first step (`share_loop_state`), so it needs
  no shared file system.
- Each step's batch is the one a single process with all the devices would
  get (`windows.WindowBatches`, a function of seed and step); each process
  feeds its own slice of it (`Cluster.part`).
- At start every process compares its settings, gin and data fingerprints
  with the chief's (`check_same`) and refuses to train on a difference,
  naming both values.
- A process that dies takes the others down: JAX's coordination service
  notices (at once when a connection drops, else after `heartbeat-timeout`)
  and ends them with a non-zero exit; `lost_contact` recognises the error a
  collective raises first, so training can print one line about it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from src.core.errors import UserError

# Settings that may differ between the processes of one run.
PER_PROCESS_KEYS = ('process-id',)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """This process's place in the run.

  Attributes:
    index: This process (0 = the chief).
    count: Processes in the run.
    local_devices: Devices this process feeds.
    devices: Devices of all processes together.
  """

  index: int = 0
  count: int = 1
  local_devices: int = 1
  devices: int = 1

  @property
  def chief(self) -> bool:
    return self.index == 0

  @property
  def prefix(self) -> str:
    """`[1/2] ` before every line a process prints (nothing if alone)."""
    return f'[{self.index + 1}/{self.count}] ' if self.count > 1 else ''

  @property
  def part(self) -> tuple[int, int] | None:
    """`(index, count)` of this process's slice of each batch, or None."""
    return (self.index, self.count) if self.count > 1 else None

  # ---- exchanging small things (every process must call these in turn)

  def broadcast_bytes(self, data: bytes | None) -> bytes:
    """The chief's `data`, on every process (the others pass None)."""
    if self.count == 1:
      return data or b''
    from jax.experimental import multihost_utils

    n = len(data) if self.chief else 0
    n = int(multihost_utils.broadcast_one_to_all(np.int64(n)))
    buf = np.zeros(max(n, 1), np.uint8)
    if self.chief and n:
      buf[:n] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return out[:n].tobytes()

  def broadcast_json(self, value=None):
    """The chief's JSON-able `value`, on every process."""
    raw = json.dumps(value).encode() if self.chief else None
    return json.loads(self.broadcast_bytes(raw).decode())

  def gather_digests(self, digests: list[str]) -> list[list[str]]:
    """Every process's `digests` (hex SHA-256 strings), by process."""
    if self.count == 1:
      return [digests]
    from jax.experimental import multihost_utils

    mine = np.array([list(bytes.fromhex(d)) for d in digests], np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return [[bytes(row).hex() for row in proc] for proc in every]


def local() -> Cluster:
  """A run of this process alone, on all its devices."""
  import jax

  n = jax.local_device_count()
  return Cluster(0, 1, n, n)


def start(s) -> Cluster:
  """Joins the run's other processes, if the settings name any.

  Must run before anything asks JAX for its devices.

  Raises:
    UserError: bad settings, or the coordinator not reached in time.
  """
  coordinator = (s['coordinator'] or '').strip()
  import jax

  if not coordinator:
    return local()
  if not jax.distributed.is_initialized():
    # On CPU the collectives between processes go through gloo (the
    # default would refuse to run them); other platforms ignore this.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    if coordinator == 'auto':
      kwargs, what = {}, 'the cluster (auto)'
    else:
      kwargs = {
        'coordinator_address': coordinator,
        'num_processes': s['num-processes'],
        'process_id': s['process-id'],
      }
      what = f'the coordinator {coordinator}'
    if coordinator != 'auto' and s['process-id'] != 0:
      # JAX ends the process (no exception) if it cannot register with the
      # coordinator in time: find out first whether anyone listens there.
      _wait_for_coordinator(coordinator, s['connect-timeout'], s)
    try:
      jax.distributed.initialize(
        initialization_timeout=s['connect-timeout'],
        heartbeat_timeout_seconds=s['heartbeat-timeout'],
        **kwargs,
      )
    except Exception as e:  # noqa: BLE001 (JAX raises several kinds)
      detail = ' '.join(str(e).split())[:300]
      raise UserError(
        f'could not join {what} within {s["connect-timeout"]} s '
        f'(process {s["process-id"]} of {s["num-processes"]}): {detail}. '
        'Start the same command on every machine (process 0 opens the '
        'port), check the address, the port and the firewall'
      ) from None
  cluster = Cluster(
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  if coordinator != 'auto' and cluster.count != s['num-processes']:
    raise UserError(
      f'the run has {cluster.count} processes but num-processes is '
      f'{s["num-processes"]}; give every process the same num-processes'
    )
  return cluster


def _wait_for_coordinator(address: str, timeout: float, s) -> None:
  """Returns once `address` accepts a TCP connection.

  Raises:
    UserError: nothing accepted one within `timeout` seconds.
  """
  import socket
  import time

  host, port = address.rsplit(':', 1)
  host = host.strip('[]')
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=2):
        return
    except OSError as e:
      problem = ' '.join(str(e).split()) or type(e).__name__
    if time.monotonic() >= deadline:
      raise UserError(
        f'could not join the coordinator {address} within {timeout:g} s '
        f'(process {s["process-id"]} of {s["num-processes"]}: {problem}); '
        'start process 0 first (it opens the port), check the address, '
        'the port and the firewall'
      )
    time.sleep(0.5)


def digest(value) -> str:
  """Hex SHA-256 of a JSON-able value (keys sorted) or of bytes/str."""
  if isinstance(value, str):
    value = value.encode()
  if not isinstance(value, bytes):
    value = json.dumps(value, sort_keys=True, default=str).encode()
  return hashlib.sha256(value).hexdigest()


# The fingerprints every process sends at start (`check_same`), in order.
FINGERPRINTS = ('settings', 'gin', 'data')
_FAILED = '00' * 32  # Sent instead by a process that could not start.


def first_mismatch(every: list[list[str]]) -> tuple[int, int] | None:
  """`(process, index)` of the first of `gather_digests`'s values that
  differs from process 0's, or None if all agree."""
  for p, values in enumerate(every[1:], start=1):
    for i, (value, chief_value) in enumerate(zip(values, every[0])):
      if value != chief_value:
        return p, i
  return None


def check_same(cluster: Cluster, named: dict[str, str] | None) -> None:
  """Refuses to go on if any process's fingerprints differ from the chief's.

  Every process calls this once at start, in step with the others.

  Args:
    named: `FINGERPRINTS` -> hex SHA-256 of each; None from a process that
      failed to start (it reports its own error; the others stop too).

  Raises:
    UserError (on every other process): naming what differs, which process
      and both values, or which process could not start.
  """
  if cluster.count == 1:
    return
  mine = [named[k] for k in FINGERPRINTS] if named else [_FAILED] * 3
  every = cluster.gather_digests(mine)
  if named is None:
    return
  for p, values in enumerate(every):
    if values[0] == _FAILED:
      raise UserError(
        f'process {p} could not start the run (its error is in its '
        'output); nothing was trained'
      )
  mismatch = first_mismatch(every)
  if mismatch is not None:
    p, i = mismatch
    raise UserError(
      f'process {p} has different {FINGERPRINTS[i]} than process 0 '
      f'({every[p][i][:12]} vs {every[0][i][:12]}); run the same command '
      'with the same config, gin file and data on every machine '
      '(only process-id differs)'
    )


def lost_contact(e: BaseException) -> bool:
  """Whether `e` is a collective failing because another process is gone."""
  text = str(e).lower()
  return any(
    s in text
    for s in (
      'gloo',
      'coordination service',
      'heartbeat',
      'nccl',
      'deadline_exceeded',
      'connection reset',
    )
  )


def private_folder(cluster: Cluster) -> str:
  """A temporary folder for a non-chief process's token cache."""
  import tempfile

  return tempfile.mkdtemp(prefix=f'jade-process{cluster.index}-')


def share_loop_state(cluster: Cluster, loop) -> None:
  """Gives every process the chief's step, weights, state and optimizer
  slots (the chief may have resumed a checkpoint or loaded a pretrained
  model; the others start from nothing)."""
  if cluster.count == 1:
    return
  import jax
  from jax.experimental import multihost_utils

  trainer = loop._trainer_per_task[0]  # noqa: SLF001 (Trax keeps it there)
  tree = (
    np.int64(loop.step),
    loop.model.weights,
    loop.model.state,
    loop.eval_model.state,
    trainer.slots,
  )
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  leaves = [np.asarray(x) for x in leaves]
  got = multihost_utils.broadcast_one_to_all(leaves)
  step, weights, state, eval_state, slots = jax.tree_util.tree_unflatten(
    treedef, [np.asarray(x) for x in got]
  )
  if cluster.chief:
    return
  loop._step = int(step)  # noqa: SLF001
  loop.update_weights_and_state(weights=weights, state=state)
  loop.eval_model.weights = loop.model.weights
  loop.eval_model.state = eval_state
  trainer.slots = slots
