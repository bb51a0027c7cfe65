"""Orbax's numpy type handler for jzo's checkpoints (`SpanHandler`, in the
`registry` jzo.checkpoint's managers use): it writes jzo.checkpoint.spans'
StreamedArrays and StreamedShards a span at a time, from every process its
own shards', and opens saved arrays as jzo.checkpoint.saved_leaf's
SavedLeafs, never a whole copy of the state on the host.
"""

from __future__ import annotations

import asyncio
import weakref

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jzo.checkpoint import spans as spans_lib
from jzo.checkpoint.saved_leaf import SavedLeaf


class SpanHandler(ocp.type_handlers.NumpyHandler):
  """Orbax's numpy handler, which also writes StreamedArrays span by span
  (never a copy of the whole: see StreamedArray.__deepcopy__), StreamedShards
  from every process (each its own shards' chunks), and opens saved arrays
  as SavedLeafs (restore_type=SavedLeaf). The files are a numpy array's:
  any reader of the checkpoint reads them as one."""

  def __init__(self):
    super().__init__()
    # event loop -> (Semaphore(SPANS_IN_FLIGHT), Lock): a span takes a permit
    # per SPAN_BYTES (a shard's chunk may be larger), under the lock so that
    # two spans never each hold part of what they wait for.
    self._in_flight = weakref.WeakKeyDictionary()

  async def _open_and_write(self, value, tspec, ts_context):
    if not isinstance(value, spans_lib.StreamedArray):
      return await super()._open_and_write(value, tspec, ts_context)
    _set_chunk_shape(tspec, value.chunk_shape)
    store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
    await self.write_spans(store, value)

  async def write_spans(self, store: ts.TensorStore, value) -> None:
    """Writes a StreamedArray's or StreamedShards' spans into `store`."""
    # Orbax writes all leaves at once: one limit over all of them bounds the
    # spans held (each until tensorstore has written it).
    in_flight, taking = self._in_flight.setdefault(
        asyncio.get_running_loop(),
        (asyncio.Semaphore(spans_lib.SPANS_IN_FLIGHT), asyncio.Lock()))
    permits = lambda nbytes: min(spans_lib.SPANS_IN_FLIGHT,
                                 max(1, -(-nbytes // spans_lib.SPAN_BYTES)))

    async def reserve(nbytes: int) -> None:
      async with taking:
        for _ in range(permits(nbytes)):
          await in_flight.acquire()

    async def written(write, nbytes: int) -> None:
      try:
        await write
      finally:  # on the loop's thread: never after the loop has closed
        for _ in range(permits(nbytes)):
          in_flight.release()
    writes = []
    async for index, values in value.spans(before_each=reserve):
      writes.append(asyncio.ensure_future(written(store[index].write(values), values.nbytes)))
    await asyncio.gather(*writes)

  async def _background_serialize(self, values, infos, args=None):
    # Orbax's numpy handler writes on the first process alone; every
    # process writes its StreamedShards.
    args = list(args) if args else [ocp.SaveArgs()] * len(values)
    mine = [isinstance(v, spans_lib.StreamedShards) for v in values]
    pick = lambda xs, want: [x for x, m in zip(xs, mine) if m == want]
    others = pick(values, False)
    if others:
      await super()._background_serialize(others, pick(infos, False), pick(args, False))
    await asyncio.gather(*(self._write_shards(v, i, a) for v, i, a in
                           zip(pick(values, True), pick(infos, True), pick(args, True))))

  async def _write_shards(self, value: spans_lib.StreamedShards, info, arg) -> None:
    """This process's chunks of `value`, into the array the first process
    creates (with OCDBT each process writes a database of its own, which
    orbax merges when the checkpoint is complete)."""
    await info.await_path_creation()
    ocdbt = info.is_ocdbt_checkpoint
    tspec = ocp.type_handlers.get_json_tspec_write(
        info, use_ocdbt=ocdbt, global_shape=value.shape, local_shape=value.chunk_shape,
        dtype=value.dtype, process_index=ocp.multihost.process_index() if ocdbt else None,
        metadata_key=self._metadata_key, arg=arg)
    tspec.setdefault("dtype", value.dtype.name)  # where this orbax leaves it to its caller
    _set_chunk_shape(tspec, value.chunk_shape)
    if ocp.multihost.process_index() == 0:
      await ts.open(ts.Spec(tspec), create=True, open=True, context=info.ts_context)
    store = await ts.open(ts.Spec(tspec), open=True, assume_metadata=True,
                          context=info.ts_context)
    await self.write_spans(store, value)

  async def deserialize(self, infos, args=None):
    args = list(args) if args else [ocp.type_handlers.RestoreArgs()] * len(infos)
    lazy = [a.restore_type is SavedLeaf for a in args]
    held = iter(await super().deserialize([i for i, x in zip(infos, lazy) if not x],
                                          [a for a, x in zip(args, lazy) if not x])
                if not all(lazy) else [])
    opened = []
    for info in (i for i, x in zip(infos, lazy) if x):
      await info.await_path_creation()
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
      opened.append(ts.open(ts.Spec(spec), open=True, context=info.ts_context))
    stores = iter(await asyncio.gather(*opened))
    return [SavedLeaf(next(stores)) if x else next(held) for x in lazy]


def registry() -> ocp.type_handlers.TypeHandlerRegistry:
  """Orbax's standard type handlers, with SpanHandler for numpy arrays,
  StreamedArrays, StreamedShards and SavedLeafs (jzo.checkpoint's managers
  use it)."""
  spans = SpanHandler()
  standard = [(ty, ocp.type_handlers.get_type_handler(ty))
              for ty in ocp.type_handlers.supported_types() if ty is not np.ndarray]
  return ocp.type_handlers.create_type_handler_registry(
      *standard, (np.ndarray, spans), (spans_lib.StreamedArray, spans),
      (spans_lib.StreamedShards, spans), (SavedLeaf, spans))


def _set_chunk_shape(tspec: dict, shape: tuple[int, ...]) -> None:
  """Makes each span one chunk of the zarr array orbax's spec describes
  (orbax would chunk a numpy array whole, or in chunks of its own, so
  that a span's write would rewrite a larger chunk)."""
  spec = tspec.get("base", tspec)  # under a cast driver, when one converts the dtype
  metadata = spec["metadata"]
  if "chunk_grid" in metadata:  # zarr v3
    metadata["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": list(shape)}}
  else:  # zarr v2
    metadata["chunks"] = list(shape)
