"""cpu_adam/cpu_adamw against optax.adam/optax.adamw, and their optax behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzo
from jzo.kernels.cpu_adam import xla_step, xla_update
from jzo.kernels.ops import adam_scalars

SHAPES = {"scalar": (), "one": (1,), "seven": (7,), "fifteen": (15,), "seventeen": (17,),
          "k": (1023,), "big": (2**20 + 3,), "cube": (3, 5, 7),
          # the offload engine's device part of a leaf kept wholly on the host
          "empty": (0,), "empty_rows": (4, 0)}
GRAD_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# 100 Adam steps accumulate a few float32 roundings of the update per step:
# float32 rounding of an O(1) parameter over 100 steps, with margin.
RTOL, ATOL = 1e-5, 2e-6


def make_params(shapes=SHAPES, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return {name: jax.random.normal(k, shape, jnp.float32)
          for k, (name, shape) in zip(keys, shapes.items())}


def gradient_pool(params, dtype, size=4):
  """`size` random gradient trees in `dtype`; step i uses pool[i % size]."""
  keys = jax.random.split(jax.random.PRNGKey(42), size)
  return [jax.tree.map(lambda p: jax.random.normal(k, p.shape).astype(dtype), params) for k in keys]


def train(tx, params, steps, grad_dtype, *, upcast=False, jit=True):
  """Runs `steps` updates; `upcast` feeds float32 copies of the gradients."""
  pool = gradient_pool(params, grad_dtype)
  if upcast:
    pool = jax.tree.map(lambda x: x.astype(jnp.float32), pool)

  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state
  step = jax.jit(step) if jit else step
  state = tx.init(params)
  for i in range(steps):
    params, state = step(params, state, pool[i % len(pool)])
  return params, state


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol), actual, expected)


def moments(state):
  return optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")


CASES = {
    "adam": (lambda: jzo.cpu_adam(1e-2), lambda: optax.adam(1e-2)),
    "adamw": (lambda: jzo.cpu_adamw(1e-2, weight_decay=0.1),
              lambda: optax.adamw(1e-2, weight_decay=0.1)),
    "adamw_mask": (
        lambda: jzo.cpu_adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
        lambda: optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()})),
    "nesterov_eps_root": (lambda: jzo.cpu_adam(1e-2, b1=0.8, b2=0.99, eps_root=1e-9, nesterov=True),
                          lambda: optax.adam(1e-2, b1=0.8, b2=0.99, eps_root=1e-9, nesterov=True)),
}


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES)
def test_matches_optax_after_100_steps(case, grad_dtype):
  make_jzo, make_optax = CASES[case]
  params = make_params()
  got, got_state = train(make_jzo(), params, 100, grad_dtype)
  want, want_state = train(make_optax(), params, 100, grad_dtype, upcast=True)
  assert_trees_close(got, want)
  assert_trees_close(moments(got_state), moments(want_state))
  assert int(got_state.count) == 100


def test_eager_matches_optax():
  params = make_params({"w": (33,), "b": ()})
  got, _ = train(jzo.cpu_adamw(1e-2, weight_decay=0.1), params, 5, jnp.float32, jit=False)
  want, _ = train(optax.adamw(1e-2, weight_decay=0.1), params, 5, jnp.float32)
  assert_trees_close(got, want)


def test_in_chain_with_clipping_and_schedules():
  lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 30)
  wd = optax.linear_schedule(0.1, 0.0, 30)
  params = make_params({"w": (64, 3), "b": (17,)})
  got, _ = train(optax.chain(optax.clip_by_global_norm(0.5), jzo.cpu_adamw(lr, weight_decay=wd)),
                 params, 30, jnp.float32)
  want, _ = train(optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(lr, weight_decay=wd)),
                  params, 30, jnp.float32)
  assert_trees_close(got, want)


def test_inject_hyperparams():
  params = make_params({"w": (100,)})
  got, state = train(optax.inject_hyperparams(jzo.cpu_adamw)(learning_rate=1e-2, b1=0.85),
                     params, 20, jnp.float32)
  want, _ = train(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, b1=0.85),
                  params, 20, jnp.float32)
  assert_trees_close(got, want)
  assert float(state.hyperparams["b1"]) == pytest.approx(0.85)


def test_xla_path_matches_kernel_path(optimized_xla):
  """The branch used when traced for an accelerator computes the same update."""
  n = 4099
  g = jax.random.normal(jax.random.PRNGKey(1), (n,)).astype(jnp.bfloat16)
  p = jax.random.normal(jax.random.PRNGKey(2), (n,))
  m = jax.random.normal(jax.random.PRNGKey(3), (n,)) * 0.1
  v = jnp.abs(jax.random.normal(jax.random.PRNGKey(4), (n,))) * 0.01
  s = adam_scalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1,
                   count=7, grad_scale=0.5)
  tx = jzo.cpu_adamw(1e-3, weight_decay=0.1)
  state = jzo.CpuAdamState(count=jnp.int32(6), mu=m, nu=v)
  # cpu_adamw's host path with grad_scale 1 on g * 0.5 == xla path with grad_scale 0.5 on g.
  u_host, st = tx.update((g.astype(jnp.float32) * 0.5), state, p)
  u_xla, m_xla, v_xla = jax.jit(lambda *a: xla_update(*a, nesterov=False))(g, m, v, p, s)
  np.testing.assert_allclose(u_host, u_xla, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(st.mu, m_xla, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(st.nu, v_xla, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("which", ["mu", "nu", "both"])
def test_bf16_moments(which):
  mu_dtype = jnp.bfloat16 if which in ("mu", "both") else None
  nu_dtype = jnp.bfloat16 if which in ("nu", "both") else None
  params = make_params({"w": (4096,), "b": (17,)})
  got, state = train(jzo.cpu_adamw(1e-2, mu_dtype=mu_dtype, nu_dtype=nu_dtype), params, 50,
                     jnp.float32)
  want, _ = train(optax.adamw(1e-2), params, 50, jnp.float32)
  assert state.mu["w"].dtype == (mu_dtype or jnp.float32)
  assert state.nu["w"].dtype == (nu_dtype or jnp.float32)
  # bf16 moments carry 8 bits of mantissa: the weights drift from the float32
  # run by a fraction of the total movement (0.5 = 50 steps * 1e-2).
  err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  assert err < 5e-3


def test_donated_state_updates_in_place():
  tx = jzo.cpu_adamw(1e-3)
  params = {"w": jnp.ones((1 << 16,), jnp.float32)}
  state = tx.init(params)
  grads = {"w": jnp.full((1 << 16,), 0.5, jnp.float32)}

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  donated = jax.jit(step, donate_argnums=(0, 1))

  pointers = lambda p, s: (p["w"].unsafe_buffer_pointer(), s.mu["w"].unsafe_buffer_pointer(),
                           s.nu["w"].unsafe_buffer_pointer())
  before = pointers(params, state)
  params, state = donated(params, state, grads)
  assert pointers(params, state) == before

  # Without donation the inputs must stay untouched (XLA copies the moments).
  mu_before = np.array(state.mu["w"])
  new_params, new_state = step(params, state, grads)
  np.testing.assert_array_equal(np.asarray(state.mu["w"]), mu_before)
  assert not np.array_equal(np.asarray(new_state.mu["w"]), mu_before)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(learning_rate=float("nan")), ValueError, "learning_rate"),
    (dict(learning_rate=-1e-3), ValueError, "learning_rate"),
    (dict(learning_rate=1e-3, b1=1.0), ValueError, "b1"),
    (dict(learning_rate=1e-3, b2=-0.1), ValueError, "b2"),
    (dict(learning_rate=1e-3, eps=float("inf")), ValueError, "eps"),
    (dict(learning_rate=1e-3, weight_decay=float("nan")), ValueError, "weight_decay"),
    (dict(learning_rate=1e-3, mu_dtype=jnp.int32), TypeError, "mu_dtype"),
    (dict(learning_rate=1e-3, mu_dtype="fast"), TypeError, "mu_dtype.*'fast'"),
    (dict(learning_rate=1e-3, nu_dtype=jnp.int8), TypeError, "nu_dtype"),
    (dict(learning_rate="fast"), TypeError, "learning_rate"),
])
def test_bad_hyperparameters(kwargs, error, words):
  with pytest.raises(error, match=words):
    jzo.cpu_adamw(**kwargs)


def test_bad_update_inputs():
  tx = jzo.cpu_adamw(1e-3)
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"\['w'\].*shape"):
    tx.update({"w": jnp.ones((3, 4)), "b": jnp.ones((3,))}, state, params)
  with pytest.raises(TypeError, match=r"\['b'\].*int32"):
    tx.update({"w": jnp.ones((4, 3)), "b": jnp.ones((3,), jnp.int32)}, state, params)
  with pytest.raises(ValueError, match="tree structures"):
    tx.update({"w": jnp.ones((4, 3))}, state, params)
  with pytest.raises(ValueError, match="params"):
    tx.update(params, state)  # weight decay needs params
  with pytest.raises(TypeError, match="CpuAdamState"):
    tx.update(params, optax.adam(1e-3).init(params)[0], params)
  with pytest.raises(TypeError, match="state.mu holds bfloat16"):
    tx.update(params, jzo.cpu_adamw(1e-3, mu_dtype=jnp.bfloat16).init(params), params)
  # Adam without decay needs no params.
  jzo.cpu_adam(1e-3).update(params, jzo.cpu_adam(1e-3).init(params))


# adamw_step: tx.update + optax.apply_updates in one in-place pass.

STEP_SHAPES = {"scalar": (), "seventeen": (17,), "cube": (3, 5, 7),
               "chunks": (70001,)}  # more than one thread's chunk of 2^16


def optax_loop(tx, params, grads, steps):
  state = tx.init(params)
  for i in range(steps):
    updates, state = tx.update(grads[i % len(grads)], state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "copied"])
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES)
def test_adamw_step_matches_optax(case, grad_dtype, donate):
  make_jzo, make_optax = CASES[case]
  params = make_params(STEP_SHAPES)
  pool = gradient_pool(params, grad_dtype)
  tx = make_jzo()
  step = jax.jit(lambda p, s, g: jzo.adamw_step(tx, g, s, p),
                 donate_argnums=(0, 1) if donate else ())
  got, state = jax.tree.map(jnp.copy, params), tx.init(params)
  for i in range(30):
    got, state = step(got, state, pool[i % len(pool)])
  want, want_state = optax_loop(make_optax(), params,
                                jax.tree.map(lambda g: g.astype(jnp.float32), pool), 30)
  assert_trees_close(got, want)
  assert_trees_close(moments(state), moments(want_state))
  assert int(state.count) == 30


def test_adamw_step_eager_with_schedule_and_bf16_moments():
  lr = optax.linear_schedule(1e-2, 1e-3, 10)
  params = make_params({"w": (65, 3), "b": (17,)})
  pool = gradient_pool(params, jnp.float32)
  tx = jzo.cpu_adamw(lr, weight_decay=0.1, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  got, state = params, tx.init(params)
  for i in range(10):
    got, state = jzo.adamw_step(tx, pool[i % len(pool)], state, got)
  want, want_state = optax_loop(tx, params, pool, 10)  # jzo's own optax path
  assert_trees_close(got, want)
  assert_trees_close(moments(state), moments(want_state))
  assert state.mu["w"].dtype == jnp.bfloat16


def test_adamw_step_xla_path_matches_kernel_path(optimized_xla):
  """The branch used when traced for an accelerator computes the same step."""
  n = 4099
  g = jax.random.normal(jax.random.PRNGKey(1), (n,)).astype(jnp.bfloat16)
  p = jax.random.normal(jax.random.PRNGKey(2), (n,))
  m = jax.random.normal(jax.random.PRNGKey(3), (n,)) * 0.1
  v = jnp.abs(jax.random.normal(jax.random.PRNGKey(4), (n,))) * 0.01
  tx = jzo.cpu_adamw(1e-3, b1=0.8, weight_decay=0.1, nesterov=True)
  s = adam_scalars(lr=1e-3, b1=0.8, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1, count=7)
  p_host, st = jzo.adamw_step(tx, g, jzo.CpuAdamState(count=jnp.int32(6), mu=m, nu=v), p)
  p_xla, m_xla, v_xla = jax.jit(lambda *a: xla_step(*a, nesterov=True))(g, m, v, p, s)
  np.testing.assert_allclose(p_host, p_xla, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(st.mu, m_xla, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(st.nu, v_xla, rtol=1e-6, atol=1e-12)


def in_place_memory(step, params, state, grads):
  """(temporary bytes, bytes aliased to the donated inputs) of the compiled step."""
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  stats = compiled.memory_analysis()
  return stats.temp_size_in_bytes, stats.alias_size_in_bytes


@pytest.mark.parametrize("path", ["optax contract", "adamw_step"])
def test_donated_step_needs_no_parameter_sized_buffer(path):
  """Under jit with donation, params and moments are updated where they are,
  and no update-sized array is written out (its fresh pages, first touched
  every step, cost more than the pass itself)."""
  n = 1 << 16
  cpu = jax.devices("cpu")[0]
  params = {"w": jax.device_put(jnp.ones((n,)), cpu)}
  grads = {"w": jax.device_put(jnp.full((n,), 0.5), cpu)}
  tx = jzo.cpu_adamw(1e-3)
  if path == "adamw_step":
    def step(params, state, grads):
      return jzo.adamw_step(tx, grads, state, params)
  else:
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  temp, aliased = in_place_memory(step, params, tx.init(params), grads)
  assert temp < n * 4
  assert aliased >= 3 * n * 4  # params, mu, nu


def test_adamw_step_donated_keeps_buffers_and_copies_without_donation():
  tx = jzo.cpu_adamw(1e-3)
  params = {"w": jnp.ones((1 << 16,), jnp.float32)}
  state = tx.init(params)
  grads = {"w": jnp.full((1 << 16,), 0.5, jnp.float32)}

  def step(params, state, grads):
    return jzo.adamw_step(tx, grads, state, params)
  pointers = lambda p, s: (p["w"].unsafe_buffer_pointer(), s.mu["w"].unsafe_buffer_pointer(),
                           s.nu["w"].unsafe_buffer_pointer())
  before = pointers(params, state)
  params, state = jax.jit(step, donate_argnums=(0, 1))(params, state, grads)
  assert pointers(params, state) == before

  p_before, mu_before = np.array(params["w"]), np.array(state.mu["w"])
  new_params, new_state = jax.jit(step)(params, state, grads)
  np.testing.assert_array_equal(np.asarray(params["w"]), p_before)
  np.testing.assert_array_equal(np.asarray(state.mu["w"]), mu_before)
  assert not np.array_equal(np.asarray(new_params["w"]), p_before)


def test_adamw_step_bad_inputs():
  tx = jzo.cpu_adamw(1e-3)
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
  state = tx.init(params)
  with pytest.raises(TypeError, match="cpu_adamw or jzo.cpu_adam"):
    jzo.adamw_step(optax.chain(optax.clip(1.0), tx), params, state, params)
  with pytest.raises(TypeError, match="cpu_adamw or jzo.cpu_adam"):
    jzo.adamw_step(optax.adamw(1e-3), params, state, params)
  with pytest.raises(ValueError, match="needs params"):
    jzo.adamw_step(tx, params, state, None)
  with pytest.raises(TypeError, match=r"params \['b'\].*bfloat16.*float32"):
    jzo.adamw_step(tx, params, state, {"w": params["w"], "b": params["b"].astype(jnp.bfloat16)})
  with pytest.raises(ValueError, match=r"\['w'\].*shape"):
    jzo.adamw_step(tx, {"w": jnp.ones((3, 4)), "b": jnp.ones((3,))}, state, params)
  with pytest.raises(TypeError, match=r"\['b'\].*int32"):
    jzo.adamw_step(tx, {"w": jnp.ones((4, 3)), "b": jnp.ones((3,), jnp.int32)}, state, params)
  with pytest.raises(ValueError, match="tree structures"):
    jzo.adamw_step(tx, {"w": jnp.ones((4, 3))}, state, params)
  with pytest.raises(ValueError, match="params and gradients"):
    jzo.adamw_step(tx, params, state, {"w": params["w"], "c": params["b"]})
  with pytest.raises(TypeError, match="CpuAdamState"):
    jzo.adamw_step(tx, params, optax.adam(1e-3).init(params)[0], params)
  with pytest.raises(TypeError, match="state.nu holds bfloat16"):
    jzo.adamw_step(tx, params, jzo.cpu_adamw(1e-3, nu_dtype=jnp.bfloat16).init(params), params)


def test_eager_steps_compile_once():
  """Called eagerly, later steps reuse the programs of the first (the step
  count must not be baked into a compiled program)."""
  tx = jzo.cpu_adamw(1e-3, weight_decay=0.1)
  params = make_params({"w": (33,), "b": ()})
  grads = gradient_pool(params, jnp.float32)[0]
  state = tx.init(params)
  compiles = []

  def on_event(event, seconds, **kwargs):
    if event.endswith("backend_compile_duration"):
      compiles.append(event)

  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  params, state = step(*step(params, state))
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    for _ in range(3):
      params, state = step(params, state)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  assert compiles == []
