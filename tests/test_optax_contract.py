"""jzo.cpu_adam/cpu_adamw keep optax.adam/optax.adamw's contract: extra
arguments along a chain, state a jitted step compiles once for, optax's
dtypes (updates under lax.cond, moments), and float64 and complex params
trained as optax trains them."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzo

PAIRS = {"adam": (jzo.cpu_adam, optax.adam), "adamw": (jzo.cpu_adamw, optax.adamw)}
VARIANTS = {
    "plain": {},
    "nesterov_eps_root": dict(b1=0.8, b2=0.99, eps_root=1e-8, nesterov=True),
    "schedule": dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)),
}
# adamw's own: a weight-decay mask, and decay by a schedule.
ADAMW_VARIANTS = {
    "mask": dict(weight_decay=0.1, mask={"w": True, "b": False}),
    "decay_schedule": dict(weight_decay=optax.linear_schedule(0.1, 0.0, 10)),
}
CASES = [(name, v) for name in PAIRS for v in VARIANTS] + [("adamw", v) for v in ADAMW_VARIANTS]


def make_pair(name, variant):
  kwargs = dict(learning_rate=1e-2)
  kwargs.update({**VARIANTS, **ADAMW_VARIANTS}[variant])
  ours, theirs = PAIRS[name]
  return ours(**kwargs), theirs(**kwargs)


def make_params(dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  return {"w": random_like(keys[0], (5, 3), dtype), "b": random_like(keys[1], (3,), dtype)}


def random_like(key, shape, dtype):
  if jnp.issubdtype(dtype, jnp.complexfloating):
    real, imag = jax.random.normal(key, (2,) + shape)
    return (real + 1j * imag).astype(dtype)
  return jax.random.normal(key, shape).astype(dtype)


def gradient_pool(params, size=3):
  keys = jax.random.split(jax.random.PRNGKey(7), size)
  return [jax.tree.map(lambda p: random_like(k, p.shape, p.dtype), params) for k in keys]


def train(tx, params, steps=20):
  """`steps` jitted updates from a pool of random gradients; (params, state)."""
  pool = gradient_pool(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  state = tx.init(params)
  for i in range(steps):
    params, state = step(params, state, pool[i % len(pool)])
  return params, state


def dtypes(tree):
  return jax.tree.map(lambda x: jnp.dtype(x.dtype), tree)


def moments(state):
  return optax.tree.get(state, "mu"), optax.tree.get(state, "nu")


def assert_trees_close(actual, expected, rtol, atol=0.0):
  assert dtypes(actual) == dtypes(expected)
  jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol,
                                                       atol=atol), actual, expected)


@contextlib.contextmanager
def lowerings():
  """Counts the programs jax lowers inside the block (each jit cache miss:
  a persistent compilation cache does not hide it)."""
  seen = []

  def on_event(event, seconds, **kwargs):
    if event.endswith("jaxpr_to_mlir_module_duration"):
      seen.append(event)
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)


# Extra arguments.

@pytest.mark.parametrize("name", PAIRS)
def test_extra_args_through_a_chain(name):
  ours, theirs = (make(1e-2) for make in PAIRS[name])
  assert isinstance(ours, optax.GradientTransformationExtraArgs)
  params = make_params(jnp.float32)

  def run(tx):
    tx = optax.chain(optax.clip_by_global_norm(0.5), tx)

    @jax.jit
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params, value=jnp.sum(params["w"]),
                                 unexpected_extra_arg=1)
      return optax.apply_updates(params, updates), state
    state, p = tx.init(params), params
    for grads in gradient_pool(params):
      p, state = step(p, state, grads)
    return p
  assert_trees_close(run(ours), run(theirs), rtol=1e-5, atol=1e-6)
  # Called on its own, too.
  ours.update(params, ours.init(params), params, value=1.0)


# Compiling once.

@pytest.mark.parametrize("commit", [False, True], ids=["uncommitted", "committed"])
def test_state_is_placed_as_optax_s(commit):
  """Committed to a device exactly where optax's state is: nowhere for
  uncommitted params, the params' device for committed ones."""
  params = make_params(jnp.float32)
  if commit:
    params = jax.device_put(params, jax.devices()[1])
  ours, theirs = make_pair("adamw", "plain")
  placement = lambda tree: [(x.committed, x.sharding) for x in jax.tree.leaves(tree)]
  assert placement(ours.init(params)) == placement(theirs.init(params))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
def test_jitted_step_compiles_once(dtype):
  params = make_params(dtype)
  for tx in reversed(make_pair("adamw", "plain")):  # optax's first: the check holds
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    grads = gradient_pool(params)[0]
    p, s = step(params, state, grads)
    with lowerings() as seen:
      for _ in range(2):
        p, s = step(p, s, grads)
    assert seen == [], f"{type(tx).__name__} recompiles its step"


# Dtypes.

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", PAIRS)
def test_updates_and_state_keep_their_dtypes_under_cond(name, dtype):
  """lax.cond's branches (update, or keep params and state) must agree: the
  updates come in the gradients' dtype, the state keeps its dtypes."""
  ours, theirs = (make(1e-2) for make in PAIRS[name])
  params = make_params(dtype)
  grads = gradient_pool(params)[0]

  @jax.jit
  def step(params, state, grads, skip):
    updates, new_state = jax.lax.cond(skip, lambda: (params, state),
                                      lambda: ours.update(grads, state, params))
    return updates, new_state
  state = ours.init(params)
  assert dtypes(moments(state)) == dtypes(moments(theirs.init(params)))
  for skip in (False, True):
    updates, new_state = step(params, state, grads, skip)
    assert dtypes(updates) == dtypes(grads)
    assert dtypes(new_state) == dtypes(state)


@pytest.mark.parametrize("params_dtype, grads_dtype", [
    (jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float16), (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.bfloat16)], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", PAIRS)
def test_mixed_dtypes_update_as_optax_promotes(name, params_dtype, grads_dtype):
  ours, theirs = (make(1e-2) for make in PAIRS[name])
  params = make_params(params_dtype)
  grads = jax.tree.map(lambda g: g.astype(grads_dtype), gradient_pool(params)[0])
  got, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  want, _ = jax.jit(theirs.update)(grads, theirs.init(params), params)
  assert dtypes(got) == dtypes(want)


@pytest.mark.parametrize("mu_dtype", [None, jnp.float32, jnp.bfloat16, jnp.float16,
                                      jnp.complex64], ids=str)
@pytest.mark.parametrize("params_dtype", [jnp.float32, jnp.bfloat16, jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
def test_moment_dtypes_are_optax_s(params_dtype, mu_dtype):
  params = make_params(params_dtype)
  got = jzo.cpu_adamw(1e-2, mu_dtype=mu_dtype).init(params)
  assert dtypes(moments(got)) == dtypes(moments(optax.adamw(1e-2, mu_dtype=mu_dtype).init(params)))
  # nu_dtype, jzo's own, sets the second moment's the same way.
  state = jzo.cpu_adamw(1e-2, nu_dtype=jnp.bfloat16).init(params)
  assert {x.dtype for x in jax.tree.leaves(state.nu)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_bf16_and_fp16_params_train_as_optax(case):
  """bfloat16 leaves run the kernel in float32, rounding the update once (optax
  rounds every operation: they drift apart by a few bfloat16 ulps); float16
  moments, which the kernel does not take, run optax's own arithmetic."""
  ours, theirs = make_pair(*case)
  for dtype, tolerance in ((jnp.bfloat16, 0.05), (jnp.float16, 2e-3)):
    params = make_params(dtype)
    (got, got_state), (want, want_state) = train(ours, params), train(theirs, params)
    assert dtypes(moments(got_state)) == dtypes(moments(want_state[0]))
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    moved = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)))
    assert err < tolerance < moved


# float64 and complex params.

@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128, jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_float64_and_complex_params_train_as_optax(case, dtype):
  """Leaves the kernel does not take run optax's arithmetic in their dtype:
  the same numbers (complex moments: nu from |g|^2)."""
  with jax.enable_x64(True):
    ours, theirs = make_pair(*case)
    params = make_params(dtype)
    (got, got_state), (want, want_state) = train(ours, params), train(theirs, params)
    rtol = 1e-13 if jnp.finfo(dtype).bits == 64 else 1e-6
    assert_trees_close(got, want, rtol=rtol)
    assert_trees_close(moments(got_state), moments(want_state[0]), rtol=rtol)


def test_one_tree_of_every_dtype():
  """float32 leaves through the kernel beside float64 and complex ones
  through optax's arithmetic, in one update."""
  with jax.enable_x64(True):
    params = {"f32": make_params(jnp.float32)["w"], "f64": make_params(jnp.float64, 1)["w"],
              "c64": make_params(jnp.complex64, 2)["w"]}
    ours, theirs = make_pair("adamw", "plain")
    (got, _), (want, _) = train(ours, params), train(theirs, params)
    assert_trees_close(got["f32"], want["f32"], rtol=1e-5, atol=2e-6)
    assert_trees_close(got["f64"], want["f64"], rtol=1e-13)
    assert_trees_close(got["c64"], want["c64"], rtol=1e-6)


def test_adamw_step_with_moments_the_kernel_does_not_take():
  params = make_params(jnp.float32)
  tx = jzo.cpu_adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.float16, nu_dtype=jnp.float16)
  got, state = params, tx.init(params)
  for grads in gradient_pool(params):
    got, state = jzo.adamw_step(tx, grads, state, got)
  want, want_state = params, tx.init(params)
  for grads in gradient_pool(params):
    updates, want_state = tx.update(grads, want_state, want)
    want = optax.apply_updates(want, updates)
  assert_trees_close(got, want, rtol=1e-6)
  assert_trees_close(moments(state), moments(want_state), rtol=0)


def test_refusals_name_the_leaf():
  params = {"w": jnp.ones((4, 3))}
  tx = jzo.cpu_adamw(1e-2, mu_dtype=jnp.int8, nu_dtype=jnp.int8)
  with pytest.raises(TypeError, match=r"\['w'\].*complex64.*int8 moments"):
    tx.update({"w": jnp.ones((4, 3), jnp.complex64)}, tx.init(params), params)
  tx = jzo.cpu_adamw(1e-2)
  with pytest.raises(TypeError, match=r"state.mu holds bfloat16 moments at \['w'\]"):
    tx.update(params, jzo.cpu_adamw(1e-2, mu_dtype=jnp.bfloat16).init(params), params)
  with pytest.raises(TypeError, match=r"state.nu holds float32 moments at \['w'\]"):
    bf16 = {"w": params["w"].astype(jnp.bfloat16)}
    tx.update(bf16, jzo.cpu_adamw(1e-2, mu_dtype=jnp.bfloat16).init(params), bf16)
