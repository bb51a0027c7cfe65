import sys, os, importlib.util, jax, jax.numpy as jnp
here = os.path.dirname(os.path.abspath(__file__))
def load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(here, name + ".py"))
  m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
n, vocab, d = 8192, 1024, 512
args = (jax.ShapeDtypeStruct((1, n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((vocab, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, n), jnp.int32))
for version in ("ce_old", "ce_new"):
  ce = load(version)
  for chunk in (896, 1024, 1920, 2048, 640, 3968, 4096):
    fn = jax.jit(jax.value_and_grad(lambda h, w, t: ce.cross_entropy(h, w, t, chunk=chunk), (0, 1)))
    c = fn.lower(*args).compile()
    t = c.memory_analysis().temp_size_in_bytes
    print(version, chunk, f"{t/2**20:.2f} MiB", flush=True)
    if version == "ce_new" and chunk in (1920, 2048):
      open(os.path.join(os.environ["OUT"], f"hlo_{chunk}.txt"), "w").write(c.as_text())
