"""The host update with parameters offloaded (offload_params; see
jzo.host.update for the modes)."""

from __future__ import annotations

from typing import Callable

import jax

from jzo.host.streamed import StreamedUpdate
from jzo.host.transfer import ShardTransfer
from jzo.host.update import PendingUpdate, TrainedState
from jzo.host.whole import WholeUpdate


class ParamsOnHost:
  """What offloaded parameters change in an update (a mixin, before the
  update it changes): the stacked layers' low-precision weights live in
  pinned host memory, and the step writes their gradients over them there
  (grads_in_params). Nothing of theirs moves: the kernel reads each
  gradient where it lies and writes the new weights in its place; then the
  resident layers' copies in device memory are made again from them. The
  other leaves take the update this is mixed into."""

  def __init__(self, state: TrainedState, transfer: ShardTransfer):
    super().__init__(state, transfer)
    plan = state.plan
    self._host_params = {i for i, l in enumerate(plan.leaves) if plan.params_on_host(l)}

  def _land(self, i: int, grad: jax.Array) -> jax.Array:
    """The params' own buffer, for leaves on the host: it is the landing buffer."""
    return grad if i in self._host_params else super()._land(i, grad)

  def _moved_bytes(self, landing: dict) -> int:
    return sum(x.nbytes for i, x in landing.items() if i not in self._host_params)

  def _install(self, pending: PendingUpdate, i) -> None:
    if i in self._host_params:  # written in place: the params are the landing buffer
      pending.landing.pop(i, None)
      self.state.refresh_resident(i)
    else:
      super()._install(pending, i)

  def _remake_weights(self, i: int, weights_leaf: jax.Array) -> None:
    if i in self._host_params:  # in place, in pinned host memory
      self.adam.lowp_weights(i, self.transfer.views(i, weights_leaf))
    else:
      super()._remake_weights(i, weights_leaf)

  def _update_in_place(self, grads: list, update: Callable) -> dict:
    return {i: self._executor.submit(update, i, None, [grads[i]]) for i in self._host_params}


class ParamsOnHostUpdate(ParamsOnHost, WholeUpdate):
  """Offloaded parameters, the other leaves' update whole."""


class StreamedParamsOnHostUpdate(ParamsOnHost, StreamedUpdate):
  """Offloaded parameters, the other leaves' update streamed."""
