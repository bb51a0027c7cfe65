"""Orbax's numpy type handler for jzo's checkpoints (`SpanHandler`, in the
`registry` jzo.checkpoint's managers use): it writes jzo.checkpoint.spans'
StreamedArrays and StreamedShards a span at a time, from every process its
own shards', and opens saved arrays as jzo.checkpoint.saved_leaf's
SavedLeafs, never a whole copy of the state on the host. It takes the
CRC32 of every chunk it writes and checks those it reads
(jzo.checkpoint.checksums).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import weakref

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jzo.checkpoint import checksums, spans as spans_lib
from jzo.checkpoint.saved_leaf import SavedLeaf



@dataclasses.dataclass
class _Saving:
  """A save under way: its checksums, and the failures of its writes. Once
  one fails, no leaf starts another span, and the save fails when those
  started have ended (none writes into its folder after orbax gave up)."""
  sums: checksums.Recorder = dataclasses.field(default_factory=checksums.Recorder)
  failures: list[Exception] = dataclasses.field(default_factory=list)


class _Stopped(Exception):
  """Another write of the save failed: no more spans."""


# The save under way, for the writes orbax's numpy handler starts.
_saving: contextvars.ContextVar[_Saving | None] = contextvars.ContextVar("jzo_saving",
                                                                         default=None)


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
    saving = _saving.get()
    if saving is None:
      return await self._write_one(value, tspec, ts_context, None)
    try:
      await self._write_one(value, tspec, ts_context,
                            saving.sums.array(_array_name(tspec), value.shape, value.dtype))
    except Exception as e:  # raised once every leaf's writes have ended
      saving.failures.append(e)

  async def _write_one(self, value, tspec, ts_context, sums) -> None:
    if not isinstance(value, spans_lib.StreamedArray):
      # A host array, whole: one chunk for the checksums, whatever orbax's.
      write = super()._open_and_write(value, tspec, ts_context)
      if sums is None or not value.size:
        return await write
      _, crc = await asyncio.gather(write, _crc32(value))
      sums.add(0, value.size, crc)
      return
    _set_chunk_shape(tspec, value.chunk_shape)
    store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
    await self.write_spans(store, value, sums)

  async def write_spans(self, store: ts.TensorStore, value,
                        sums: checksums.ArraySums | None = None) -> None:
    """Writes a StreamedArray's or StreamedShards' spans into `store`, each
    span's CRC32 into `sums` (where given) as it is written."""
    # Orbax writes all leaves at once: one limit over all of them bounds the
    # spans held (each until tensorstore has written it).
    in_flight, taking = self._in_flight.setdefault(
        asyncio.get_running_loop(),
        (asyncio.Semaphore(spans_lib.SPANS_IN_FLIGHT), asyncio.Lock()))
    permits = lambda nbytes: min(spans_lib.SPANS_IN_FLIGHT,
                                 max(1, -(-nbytes // spans_lib.SPAN_BYTES)))

    saving = _saving.get()

    async def reserve(nbytes: int) -> None:
      if saving is not None and saving.failures:
        raise _Stopped()
      async with taking:
        for _ in range(permits(nbytes)):
          await in_flight.acquire()

    async def written(index, values) -> None:
      try:
        if sums is None:
          return await store[index].write(values)
        _, crc = await asyncio.gather(store[index].write(values), _crc32(values))
        start, stop = checksums.flat_range(index, value.shape)
        sums.add(start, stop - start, crc)
      except Exception as e:
        if saving is not None:
          saving.failures.append(e)
        raise
      finally:  # on the loop's thread: never after the loop has closed
        for _ in range(permits(values.nbytes)):
          in_flight.release()
    writes = []
    try:
      async for index, values in value.spans(before_each=reserve):
        writes.append(asyncio.ensure_future(written(index, values)))
    except _Stopped:
      pass
    finally:  # the writes started end first, whatever stopped the spans
      ended = await asyncio.gather(*writes, return_exceptions=True)
    failed = [e for e in ended if isinstance(e, BaseException)]
    if failed:
      raise failed[0]

  async def _background_serialize(self, values, infos, args=None):
    # Orbax's numpy handler writes on the first process alone; every
    # process writes its StreamedShards.
    args = list(args) if args else [ocp.SaveArgs()] * len(values)
    mine = [isinstance(v, spans_lib.StreamedShards) for v in values]
    pick = lambda xs, want: [x for x, m in zip(xs, mine) if m == want]
    others = pick(values, False)
    saving = _Saving()
    _saving.set(saving)  # this task's: the writes it starts inherit it
    if others:
      await super()._background_serialize(others, pick(infos, False), pick(args, False))
    ended = await asyncio.gather(*(self._write_shards(v, i, a, saving.sums) for v, i, a in
                                   zip(pick(values, True), pick(infos, True), pick(args, True))),
                                 return_exceptions=True)
    saving.failures += [e for e in ended if isinstance(e, Exception)]
    if saving.failures:
      raise saving.failures[0]
    if infos:  # every process, with checksums or none: a restore counts them
      await infos[0].await_path_creation()
      await asyncio.to_thread(saving.sums.write, infos[0].parent_dir,
                              ocp.multihost.process_index())

  async def _write_shards(self, value: spans_lib.StreamedShards, info, arg,
                          recorder: checksums.Recorder) -> None:
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
    await self.write_spans(store, value, recorder.array(info.name, value.shape, value.dtype))

  async def deserialize(self, infos, args=None):
    args = list(args) if args else [ocp.type_handlers.RestoreArgs()] * len(infos)
    lazy = [a.restore_type is SavedLeaf for a in args]
    held = await super().deserialize([i for i, x in zip(infos, lazy) if not x],
                                     [a for a, x in zip(args, lazy) if not x]) \
        if not all(lazy) else []
    written = {}  # item folder -> its checksums (None: written before them)
    for info in infos:
      await info.await_path_creation()
      if info.parent_dir not in written:
        written[info.parent_dir] = await asyncio.to_thread(checksums.read, info.parent_dir)
    sums = [_sums_of(written[i.parent_dir], i.name) for i in infos]
    stores = iter(await asyncio.gather(*(
        _open_saved(i) for i, s, x in zip(infos, sums, lazy) if x or s is not None)))
    out, held = [], iter(held)
    for x, s in zip(lazy, sums):
      store = next(stores) if x or s is not None else None
      if s is not None:
        s.check_store(store)
      if x:
        out.append(SavedLeaf(store, s))
        continue
      value = next(held)
      if s is not None:
        # As read: in the saved shape and dtype (else orbax cut, padded or
        # cast it, and the saved array is read again to be checked).
        same = tuple(np.shape(value)) == s.shape and np.dtype(value.dtype).name == s.dtype
        await asyncio.to_thread(s.check_whole, np.asarray(value) if same else
                                (await store.read()))
      out.append(value)
    return out


async def _open_saved(info) -> ts.TensorStore:
  """A saved array opened for reading, as it was written."""
  spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
  return await ts.open(ts.Spec(spec), open=True, context=info.ts_context)


def _sums_of(written: dict | None, name: str) -> checksums.ArraySums | None:
  """Array `name`'s checksums; None where the checkpoint has none (written
  before them) or the array has none (one of orbax's own handlers wrote it;
  jzo.checkpoint.files counts the processes' files)."""
  return None if written is None else written.get(name)


async def _crc32(values: np.ndarray) -> int:
  """checksums.crc32 of `values` on its threads, beside the write."""
  return await asyncio.get_running_loop().run_in_executor(checksums.threads(), checksums.crc32,
                                                          values)


def _array_name(tspec: dict) -> str:
  """The name orbax gives the array a write spec writes (as its ParamInfo's):
  the path in the checkpoint's OCDBT database, or its folder's name."""
  kvstore = tspec.get("base", tspec)["kvstore"]
  path = kvstore["path"].rstrip("/")
  return path if kvstore["driver"] == "ocdbt" else path.rsplit("/", 1)[-1]


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
