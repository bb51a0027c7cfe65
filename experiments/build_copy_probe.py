"""The build's copy of a leaf's host part to host memory (jzo.transfer.
copy_to_host, from jzo.state.build_state): XLA's temporary bytes of its
programs, for the host part of all of a process's shards at once against
one shard's, compiled (not run) on this machine's first device, for a leaf split as
offload="auto" splits one (--on-device of each shard's state on the GPU).

A per-layer leaf's host part of several shards is a transpose of the draw;
gpt2-20b's MLP kernel stacked 104 deep over 4 GPUs (62.8 GB in float32)
failed to build asking for a 58.52 GiB copy of it.

  python experiments/build_copy_probe.py [--layers 104] [--shards 4]
"""

import argparse
import math

import jax
import jax.numpy as jnp

from jzo import partition, transfer


def temp_gib(program, *args) -> float:
  return program.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=104)
  parser.add_argument("--shards", type=int, default=4)
  parser.add_argument("--d-model", type=int, default=6144)
  parser.add_argument("--on-device", type=float, default=0.3,
                      help="share of each shard whose state is on the device (auto's split)")
  args = parser.parse_args()
  d = args.d_model
  layout = partition.LeafLayout((args.layers, d, 4 * d), args.shards, per_layer=True)
  layout = layout.place(int(args.on_device * layout.shard_size) // 16 * 16)
  x = jax.ShapeDtypeStruct(layout.flat_shape, jnp.float32)
  print(f"{jax.devices()[0].device_kind}: leaf {layout.shape}, {args.shards} shards, "
        f"{math.prod(x.shape) * 4 / 2**30:.2f} GiB in float32, {layout.on_host} of each shard's "
        f"{layout.shard_size} elements a layer on the host", flush=True)
  for name, positions in (("all shards", (0, args.shards)), ("one shard", (0, 1))):
    part = partition.SplitPart(layout, 1, positions)
    size = math.prod(jax.eval_shape(part, x).shape)
    main_rows = size // transfer._ROW
    rows = min(main_rows, max(1, transfer.BUILD_CHUNK_BYTES // (4 * transfer._ROW)))
    tail = size - main_rows * transfer._ROW
    print(f"  {name}: a chunk of rows {temp_gib(transfer._rows_of, x, 0, rows, part):.2f} "
          f"GiB of temporaries"
          + (f", the tail {temp_gib(transfer._tail_of, x, main_rows * transfer._ROW, part):.2f}"
             if tail else ", no tail"))


if __name__ == "__main__":
  main()
