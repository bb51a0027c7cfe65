"""Hugging Face data files: the rows of parquet files and of Arrow IPC files (the
`datasets` library's save_to_disk and cache files), read with pyarrow a few rows at a
time, as the records JSONL lines hold.

A file's columns pick its form, as a JSONL line's keys do (jzo.recipe.tokens): a
`messages` column (a list of {role, content} structs), else `prompt` and `completion`,
else `text`; the other columns are not read. pyarrow is optional: `pip install
'jzo[data]'`.
"""

from __future__ import annotations

import pathlib
from typing import Iterator

SUFFIXES = frozenset({".parquet", ".arrow"})
# Rows turned into Python objects at a time: a shard of any size is read a slice at a time.
ROWS = 1024
FORMS = (("messages",), ("prompt", "completion"), ("text",))  # JSONL's order of precedence


class TableError(ValueError):
  """A table file that cannot be read; the message is one line naming it."""


def records(path: pathlib.Path) -> Iterator[tuple[dict | None, int]]:
  """Each row of a .parquet or .arrow file as a record of its form's columns (a message's
  null fields, which Arrow gives where a JSONL line would leave the key out, left out), with
  the bytes of the file it took; a last None takes the bytes no row took.

  Raises:
    TableError: pyarrow is not installed, the file is not one pyarrow reads, or its
      columns are not a form's (or not of its types).
  """
  schema, batches = _open(path)
  columns = _form(schema, path)
  reported = 0
  for batch, done in batches(columns):
    for start in range(0, batch.num_rows, ROWS):
      part = batch.slice(start, ROWS)
      values = [part.column(name).to_pylist() for name in columns]
      last = start + part.num_rows == batch.num_rows
      for i, row in enumerate(zip(*values)):
        record = dict(zip(columns, row))
        if "messages" in record and isinstance(record["messages"], list):
          record["messages"] = [_present(m) for m in record["messages"]]
        n_bytes = done - reported if last and i == part.num_rows - 1 else 0
        reported += n_bytes
        yield record, n_bytes
  if (size := path.stat().st_size) > reported:
    yield None, size - reported


def _present(message):
  """A message struct without its null fields but role and content (checked as JSONL's)."""
  if not isinstance(message, dict):
    return message
  return {k: v for k, v in message.items() if v is not None or k in ("role", "content")}


def _pyarrow(path: pathlib.Path):
  try:
    import pyarrow
    import pyarrow.parquet  # noqa: F401 (pyarrow.parquet is a module of its own)
  except ImportError:
    raise TableError(f"data file {path}: reading {path.suffix[1:]} files needs pyarrow: "
                     "pip install 'jzo[data]' (or pip install pyarrow)") from None
  return pyarrow


def _open(path: pathlib.Path):
  """(the file's arrow schema, batches(columns) -> iterator of (record batch, bytes of the
  file read through it)); a parquet file is read a batch of ROWS rows at a time, an Arrow
  file memory-mapped a record batch at a time."""
  pa = _pyarrow(path)
  size = path.stat().st_size
  try:
    if path.suffix == ".parquet":
      table = pa.parquet.ParquetFile(path, memory_map=True)
      n_rows = table.metadata.num_rows

      def parquet_batches(columns):
        done = 0
        for batch in table.iter_batches(batch_size=ROWS, columns=list(columns)):
          done += batch.num_rows
          yield batch, size * done // max(n_rows, 1)
      return table.schema_arrow, _reading(parquet_batches, path)
    source = pa.memory_map(str(path))
    if source.read(6) == b"ARROW1":  # the file format; a stream starts with its schema
      reader = pa.ipc.open_file(source)

      def file_batches(columns):
        n = reader.num_record_batches
        for i in range(n):
          yield reader.get_batch(i), size * (i + 1) // n
      return reader.schema, _reading(file_batches, path)
    source.seek(0)
    reader = pa.ipc.open_stream(source)

    def stream_batches(columns):
      for batch in reader:
        yield batch, source.tell()
    return reader.schema, _reading(stream_batches, path)
  except (pa.ArrowException, OSError) as e:
    kind = "a parquet file" if path.suffix == ".parquet" else "an Arrow IPC file or stream"
    raise TableError(f"data file {path} is not {kind} pyarrow reads: "
                     f"{_first_line(e)}") from None


def _reading(batches, path: pathlib.Path):
  """`batches` with pyarrow's errors while reading (a cut or corrupt file) as TableErrors."""
  import pyarrow as pa

  def read(columns):
    try:
      yield from batches(columns)
    except (pa.ArrowException, OSError) as e:
      raise TableError(f"data file {path} cannot be read: {_first_line(e)}") from None
  return read


def _first_line(error: Exception) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _form(schema, path: pathlib.Path) -> tuple[str, ...]:
  """The columns of the file's form, their types checked.

  Raises:
    TableError: no form's columns, or a column of the form of another type.
  """
  names = schema.names
  for form in FORMS:
    if all(name in names for name in form):
      for name in form:
        kind = schema.field(name).type
        if name == "messages" and not _is_messages(kind):
          raise TableError(f"data file {path}: column \"messages\" is {kind}, not a list of "
                           "{role, content} structs of strings")
        if name != "messages" and not _is_string(kind):
          raise TableError(f"data file {path}: column \"{name}\" is {kind}, not a string")
      return form
  raise TableError(f"data file {path} has columns {', '.join(names) or 'none'}; jzo reads a "
                   "text column, prompt and completion, or messages")


def _is_string(kind) -> bool:
  import pyarrow as pa
  if pa.types.is_dictionary(kind):  # categorical strings, as pandas writes them
    kind = kind.value_type
  return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
          or getattr(pa.types, "is_string_view", lambda _: False)(kind))


def _is_messages(kind) -> bool:
  """A list of structs with string fields role and content (other fields allowed)."""
  import pyarrow as pa
  lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list,
           getattr(pa.types, "is_list_view", lambda _: False),
           getattr(pa.types, "is_large_list_view", lambda _: False))
  if not any(is_list(kind) for is_list in lists) or not pa.types.is_struct(kind.value_type):
    return False
  struct = kind.value_type
  return all(struct.get_field_index(name) >= 0 and _is_string(struct.field(name).type)
             for name in ("role", "content"))
