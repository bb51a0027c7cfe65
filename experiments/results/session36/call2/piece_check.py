"""Compile-only: do the build's programs copy a leaf on this GPU? (temp bytes)"""
import jax, jax.numpy as jnp
from jzo import partition, state, transfer
from jzo.partition import LeafLayout
dev = jax.devices()[0]
on = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(dev))
layout = LeafLayout((16, 4096, 16384), 4, per_layer=True).place(8 * 2**20)
flat = on(layout.flat_shape, jnp.float32)
for name, fn in [("lowp sharded", state._LowpFromMaster(jnp.bfloat16, True, layout)),
                 ("lowp whole", state._LowpFromMaster(jnp.bfloat16, False, layout)),
                 ("device part", partition.SplitPart(layout, 0))]:
  out = jax.eval_shape(fn, flat)
  sizes = out.shape[:-1] + (out.shape[-1] // 4,) if name != "lowp whole" else out.shape
  m = state._piece_of.lower(flat, fn, sizes, (0,) * len(sizes)).compile().memory_analysis()
  w = state._write_into.lower(on(out.shape, out.dtype), flat, fn).compile().memory_analysis()
  print(f"{name}: piece temp {m.temp_size_in_bytes / 2**20:.1f} MiB out {m.output_size_in_bytes / 2**20:.1f};"
        f" write temp {w.temp_size_in_bytes / 2**20:.1f} MiB (input {4 * layout.flat_shape[0] * layout.flat_shape[1] / 2**20:.0f})")
