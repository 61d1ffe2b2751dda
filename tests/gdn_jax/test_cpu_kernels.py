"""The compiled CPU kernels (gdn_jax/cpu_kernels.py: the GDN decode update, decode attention, few-row bfloat16
products) against XLA's forms of the same computations, and how the engine behaves where the kernels cannot be
built."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.backends.cpu import library, tuning
from gdn_jax.backends.cpu import kernels as cpu_kernels
from gdn_jax.model import gated_delta
from gdn_jax.model import attention
from gdn_jax.model import dense
from gdn_jax.model import qwen35
from gdn_jax.model import state
from gdn_jax.model.forms import Forms
from gdn_jax.config import get_preset

pytestmark = pytest.mark.model

KERNELS, XLA = Forms(cpu=True, kernels=True), Forms(cpu=True)  # the CPU forms with the kernels, and XLA's


@pytest.fixture
def fresh_choice(monkeypatch):
    """Runs a test with the kernel's availability decided again, and decides it again after (with the test's
    environment undone), so that no other test sees the test's choice."""
    library.available.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    library.available.cache_clear()


def _case(rng, rows=7, layers=3, slots=20, heads=3, dim=16):
    """A pool and one token per row: row 1 cold (zeros, whatever its slot holds), rows 2 and 5 restoring from other
    slots, row 4 a padding row (lengths 0, writing slot 0 like the engine's), the rest continuing their own slots."""
    pool = (rng.standard_normal((layers, slots, heads, dim, dim)) * 0.1).astype(np.float32)
    live = np.array([3, 7, 11, 5, 0, 13, 17], np.int32)[:rows]
    src = live.copy()
    src[2], src[5] = 9, 19
    warm = np.ones(rows, bool)
    warm[1] = False
    lengths = np.ones(rows, np.int32)
    lengths[4] = 0
    k = rng.standard_normal((rows, 1, heads, dim)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.standard_normal((rows, 1, heads, dim)).astype(np.float32) / np.sqrt(dim)
    v = rng.standard_normal((rows, 1, heads, dim)).astype(jnp.bfloat16)
    g = -np.abs(rng.standard_normal((rows, 1, heads))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((rows, 1, heads))))).astype(np.float32)
    return pool, (src, live, warm, lengths, q, k, v, g, beta)


def _over_layers(pool, args, layer_known: bool, forms: Forms):
    """Every layer's update in turn, the layer index traced (the layer loop) or known (unrolled layers)."""
    layers = pool.shape[0]
    if layer_known:
        outs = []
        for j in range(layers):
            o, pool = qwen35.advance_in_pool(pool, *args, layer=j, forms=forms)
            outs.append(o)
        return jnp.stack(outs), pool

    def body(j, carry):
        pool, outs = carry
        o, pool = qwen35.advance_in_pool(pool, *args, layer=j, forms=forms)
        return pool, outs.at[j].set(o)
    v = args[6]
    pool, outs = jax.lax.fori_loop(0, layers, body, (pool, jnp.zeros((layers,) + v.shape, v.dtype)))
    return outs, pool


def _run(pool, args, layer_known, forms: Forms):
    fn = jax.jit(lambda pool, *args: _over_layers(pool, args, layer_known, forms), donate_argnums=0)
    return fn(jnp.asarray(pool), *map(jnp.asarray, args)), fn


@pytest.mark.parametrize("layer_known, dim", [(False, 16), (True, 16), (False, 8)])
def test_the_kernel_updates_states_as_xla_does(layer_known, dim, fresh_choice):
    """Where a C++ compiler is, the kernel is built and every output and every slot of the pool (those no row
    writes included) agree with XLA's form to float32 rounding: cold, restoring, continuing and padding rows, the
    layer traced or known, a head dimension of 16 (the vector writes, where the CPU has AVX-512) and of 8 (the plain
    loop). Where none is, the engine warns once and runs XLA's form."""
    rng = np.random.default_rng(0)
    pool, args = _case(rng, dim=dim)
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert not library.available()
        return
    assert library.available()
    (o_kernel, pool_kernel), fn = _run(pool, args, layer_known, KERNELS)
    text = fn.lower(jnp.asarray(pool), *map(jnp.asarray, args)).compile().as_text()
    assert cpu_kernels.TARGET in text
    # in place: no copy of the pool (nor a second pool-sized buffer) in the compiled program
    assert not re.search(rf"f32\[3,20,3,{dim},{dim}\]\{{[0-9,]+\}} copy\(", text)
    (o_xla, pool_xla), fn = _run(pool, args, layer_known, XLA)
    assert cpu_kernels.TARGET not in fn.lower(jnp.asarray(pool), *map(jnp.asarray, args)).compile().as_text()
    np.testing.assert_allclose(np.asarray(o_kernel, np.float32), np.asarray(o_xla, np.float32), rtol=1e-2, atol=1e-2)
    assert o_kernel.dtype == o_xla.dtype == jnp.bfloat16
    pk, px = np.asarray(pool_kernel), np.asarray(pool_xla)
    np.testing.assert_allclose(pk, px, rtol=1e-5, atol=1e-6)
    written = {3, 7, 11, 5, 0, 13, 17}
    untouched = [s for s in range(pool.shape[1]) if s not in written]
    np.testing.assert_array_equal(pk[:, untouched], pool[:, untouched])  # restore sources included: read, not moved
    assert not np.array_equal(pk[:, 7], pool[:, 7])  # the cold row wrote its new state
    np.testing.assert_allclose(pk[:, 7], px[:, 7], rtol=1e-5, atol=1e-6)


def test_float32_outputs_agree_to_rounding(fresh_choice):
    """The rows' outputs in float32 (v float32): the same values as XLA's to float32 rounding."""
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning):
            assert not library.available()
        return
    assert library.available()
    rng = np.random.default_rng(1)
    pool, args = _case(rng, dim=64, heads=2)
    args = args[:6] + (args[6].astype(np.float32),) + args[7:]
    (o_kernel, _), _ = _run(pool, args, False, KERNELS)
    (o_xla, _), _ = _run(pool, args, False, XLA)
    np.testing.assert_allclose(np.asarray(o_kernel), np.asarray(o_xla), rtol=2e-5, atol=2e-6)


def _prefill_case(rng, dim, rows=4, tokens=37, heads=2, key_heads=2):
    """A prefill step's inputs: row 0 full, row 1 shorter, row 2 a padding row (length 0), row 3 with a reset
    (g = -inf) and NaN garbage past its end; warm states; saves at several counts per row, out of order, at 0, at
    the row's length and past it (clamped to it), and one of a padding row. q and k have `key_heads` heads."""
    shape = (rows, tokens, heads, dim)
    q = rng.standard_normal((rows, tokens, key_heads, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(shape).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, shape[:3]).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, shape[:3]).astype(np.float32)
    lengths = np.array([tokens, 20, 0, 30], np.int32)[:rows]
    g[3, 9, 1] = -np.inf
    q[3, 30:], v[3, 31:] = np.nan, np.inf
    s0 = (rng.standard_normal((rows, heads, dim, dim)) * 0.2).astype(np.float32)
    save_rows = np.array([0, 1, 0, 3, 1, 2, 3, 0], np.int32)
    save_counts = np.array([32, 16, 8, 30, 40, 0, 0, 37], np.int32)
    return (q, k, v, g, beta, s0, lengths), (save_rows, save_counts)


@pytest.mark.parametrize("dim, key_heads", [(16, 2), (64, 1), (128, 2), (256, 1)])
def test_the_prefill_kernel_runs_the_rule_as_xla_does(dim, key_heads, fresh_choice):
    """Every token of a prefill step, token by token (`cpu_kernels.gdn_prefill`): the outputs, final states and
    saved states of XLA's recurrent form to float32 rounding, with ragged rows, a padding row, a reset and garbage
    past a row's end, at each of the kernel's forms of a state's pass (16: any width; 64 and 128: the state's row in
    registers; 256: two blocks of 128 columns), with a key head for each value head or one for both (read where
    it lies, where XLA's form takes them repeated)."""
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning):
            assert not library.available()
        return
    assert library.available()  # (it registers the kernels with XLA)
    rng = np.random.default_rng(dim)
    args, saves = _prefill_case(rng, dim, key_heads=key_heads)
    q, k, v, g, beta, s0, lengths = args
    assert cpu_kernels.prefill_applies(jnp.asarray(k), jnp.asarray(v), KERNELS)
    assert not cpu_kernels.prefill_applies(jnp.asarray(k), jnp.asarray(v), XLA)
    assert not cpu_kernels.prefill_applies(jnp.zeros((4, 37, 3, dim)), jnp.asarray(v[:, :, :2]), KERNELS)  # 3 into 2
    fn = jax.jit(cpu_kernels.gdn_prefill)
    o, final, saved = fn(*args, saves)
    assert cpu_kernels.PREFILL_TARGET in fn.lower(*args, saves).compile().as_text()
    expanded = [np.repeat(a, v.shape[2] // key_heads, axis=2) for a in (q, k)] + list(args[2:])
    o_ref, final_ref = gated_delta.recurrent_gated_delta_rule(*map(jnp.asarray, expanded))
    tol = dict(rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), **tol)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_ref), **tol)
    assert np.isfinite(np.asarray(o)).all()
    for r, n in enumerate(lengths):
        assert not np.asarray(o[r, n:]).any()  # padding: zeros
    np.testing.assert_array_equal(np.asarray(final[2]), s0[2])  # a padding row's state is left as it was
    rows, counts = saves
    for s, (r, c) in enumerate(zip(rows, counts)):
        upto = np.minimum(lengths, 0)
        upto[r] = min(c, lengths[r])
        _, state = gated_delta.recurrent_gated_delta_rule(*map(jnp.asarray, expanded[:6]), jnp.asarray(upto))
        np.testing.assert_allclose(np.asarray(saved[s]), np.asarray(state[r]), err_msg=f"save {s}", **tol)
    np.testing.assert_array_equal(np.asarray(saved[5]), s0[2])  # after 0 tokens: the entering state
    o2, final2 = fn(*args)  # no saves: the same rule
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(final2), np.asarray(final))


def test_the_prefill_kernel_gives_a_row_the_same_bits_whatever_the_other_rows_and_the_split(fresh_choice):
    """A row's outputs and states do not depend on the other rows of the step, and a prompt run in two steps (the
    second from the first's final state) gives the bits of one step: what makes a restored checkpoint's
    continuation bitwise the uncached prefill's in the rule."""
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning):
            assert not library.available()
        return
    assert library.available()
    args, _ = _prefill_case(np.random.default_rng(5), 64)
    q, k, v, g, beta, s0, lengths = args
    fn = jax.jit(cpu_kernels.gdn_prefill)
    o, final = fn(*args)
    o1, final1 = fn(*(a[:1] for a in args))
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o[:1]))
    np.testing.assert_array_equal(np.asarray(final1), np.asarray(final[:1]))
    cut = 16
    first = [a[:1, :cut] for a in (q, k, v, g, beta)]
    oa, sa = fn(*first, s0[:1], np.array([cut], np.int32))
    ob, sb = fn(*(a[:1, cut:] for a in (q, k, v, g, beta)), sa, lengths[:1] - cut)
    np.testing.assert_array_equal(np.concatenate([np.asarray(oa), np.asarray(ob)], 1), np.asarray(o[:1]))
    np.testing.assert_array_equal(np.asarray(sb), np.asarray(final[:1]))


def test_no_compiler_means_xla_form_with_one_warning_or_an_error_when_required(fresh_choice, tmp_path):
    fresh_choice.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler on PATH.*no-such-compiler"):
        assert not library.available()
    forms = tuning.product_forms(jnp.float32)  # decided once: no second warning
    assert not forms.kernels and not cpu_kernels.applies(jnp.zeros((1, 2, 1, 4, 4), jnp.float32), forms)
    assert not cpu_kernels.attention_applies(jnp.zeros((1, 1, 2, 16, 32), jnp.uint16), 4, forms)
    library.available.cache_clear()
    fresh_choice.setenv(library.KERNELS_ENV, "1")
    with pytest.raises(RuntimeError, match="GDN_JAX_CPU_KERNELS=1, but the CPU kernels could not be built"):
        library.available()


def test_a_failed_build_names_the_compilers_message(fresh_choice, tmp_path):
    """A compiler that fails (here: one that prints a message and exits 1): its message in the error, nothing
    left in the kernels' folder."""
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho 'fatal: cannot build this' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exit 1.*fatal: cannot build this"):
        library.build(str(fake), tmp_path / "kernels")
    assert list((tmp_path / "kernels").iterdir()) == []


def test_each_source_compiles_on_its_own_then_one_link_whose_failure_is_named(tmp_path):
    """The build compiles every source to an object of its own (`-c`), then links them: a compiler that compiles
    but fails to link, its message in the error, nothing left in the kernels' folder."""
    log, fake = tmp_path / "calls", tmp_path / "fake-c++"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {log}
case " $* " in
  *" -c "*) while [ "$1" != "-o" ]; do shift; done; touch "$2"; exit 0 ;;
esac
echo 'ld: cannot link these' >&2
exit 2
""")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exit 2.*ld: cannot link these"):
        library.build(str(fake), tmp_path / "kernels")
    assert list((tmp_path / "kernels").iterdir()) == []
    calls = log.read_text().splitlines()
    compiled = sorted(call.split(" -c ")[1].split()[0].rsplit("/", 1)[1] for call in calls if " -c " in call)
    assert compiled == sorted(library.SOURCES) and all("-shared" not in c for c in calls if " -c " in c)
    (link,) = [call for call in calls if " -c " not in call]
    assert "-shared" in link and sum(arg.endswith(".o") for arg in link.split()) == len(library.SOURCES)


@pytest.mark.parametrize("value", ["2", "yes"])
def test_the_setting_is_checked(value, fresh_choice):
    fresh_choice.setenv(library.KERNELS_ENV, value)
    with pytest.raises(ValueError, match="GDN_JAX_CPU_KERNELS must be one of 0"):
        library.available()


def test_off_means_xla_form(fresh_choice):
    fresh_choice.setenv(library.KERNELS_ENV, "0")
    assert not library.available()
    forms = tuning.product_forms(jnp.float32)
    assert forms.cpu and not forms.kernels
    assert not cpu_kernels.applies(jnp.zeros((1, 2, 1, 4, 4), jnp.float32), forms)
    assert not cpu_kernels.attention_applies(jnp.zeros((1, 1, 2, 16, 32), jnp.uint16), 4, forms)


def _attention_case(dtype, block_size, dim, longest, rng, heads=8):
    """An attention layer (`heads` query heads on 2 KV heads of `dim`), paged caches of 3 layers filled with random
    keys and values, and one token per row: rows of 1, 37, 16 and `longest` keys (one block, a block boundary, a
    whole block, many), their blocks scattered and in no order, and a padding row (lengths 0) at position 0 on block
    0."""
    cfg = dataclasses.replace(get_preset("tiny-random"), num_attention_heads=heads, num_key_value_heads=2,
                              head_dim=dim)
    layer = attention.Attention(cfg, dtype, nnx.Rngs(0), 0.2)
    starts = np.array([0, 36, 15, longest - 1, 0], np.int32)
    width = -(-longest // block_size) + 1
    blocks = 3 * width + 2
    tables = np.zeros((5, width), np.int32)
    free = list(rng.permutation(np.arange(1, blocks)))
    for r, s in enumerate(starts[:4]):
        tables[r, :s // block_size + 1] = [free.pop() for _ in range(s // block_size + 1)]
    slot = tables[np.arange(5), starts // block_size] * block_size + starts % block_size
    slot[4] = 0
    batch = state.Batch(tokens=jnp.zeros((5, 1), jnp.int32), start_pos=jnp.asarray(starts),
                        lengths=jnp.asarray([1, 1, 1, 1, 0], jnp.int32), block_tables=jnp.asarray(tables),
                        slot_mapping=jnp.asarray(slot[:, None]), linear_state_ids=jnp.zeros(5, jnp.int32),
                        has_initial_state=jnp.ones(5, bool))
    shape = (2, 3, blocks, block_size, dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    k, v = (state.to_pool(a, jnp.zeros((), state.pool_dtype(dtype))) for a in (k, v))
    x = jnp.asarray(rng.standard_normal((5, 1, cfg.hidden_size)), dtype)
    return layer, x, k, v, batch


def _attend(layer, x, k, v, batch, forms: Forms):
    """The layer's output for every layer of the caches in turn (the layer index traced: the layer loop), the caches
    donated and carried as the engine's step does; and the compiled program's text."""
    graphdef, params = nnx.split(layer)

    def each_layer(params, x, k, v, batch):
        def body(j, carry):
            k, v, outs = carry
            out, k, v = nnx.merge(graphdef, params)(x, k, v, batch, j, forms)
            return k, v, outs.at[j].set(out)
        return jax.lax.fori_loop(0, k.shape[1], body, (k, v, jnp.zeros((k.shape[1],) + x.shape, x.dtype)))

    # a function of its own per call: no trace shared across the two paths
    fn = jax.jit(lambda *a: each_layer(*a), donate_argnums=(2, 3))
    text = fn.lower(params, x, k, v, batch).compile().as_text()
    return fn(params, x, jnp.copy(k), jnp.copy(v), batch)[2], text


@pytest.mark.parametrize("dtype, block_size, dim, longest, heads", [
    (jnp.float32, 16, 64, 1000, 8), (jnp.bfloat16, 16, 32, 150, 8), (jnp.bfloat16, 80, 32, 150, 8),
    (jnp.float32, 16, 40, 100, 6), (jnp.float32, 32, 80, 70, 2), (jnp.bfloat16, 32, 64, 90, 32)])
def test_the_attention_kernel_attends_as_xla_does(dtype, block_size, dim, longest, heads, fresh_choice):
    """A one-token step's attention by the kernel and by XLA's form: the same outputs for every row and layer (to
    float32 rounding; in bfloat16 to the rounding of XLA's probabilities to bfloat16 before their product with the
    values), the cache read in place (no copy of it), blocks of more keys than the kernel takes at a time (80)
    included, and rows shared among threads (the float32 case: enough keys to wake XLA's pool); head dimensions that
    are not a multiple of the kernel's 16-lane vectors (40, 80), and groups of 1, 3, 4 and 16 query heads per KV head
    (the kernel multiplies four at a time). Where no compiler is, the engine warns and runs XLA's form."""
    layer, x, k, v, batch = _attention_case(dtype, block_size, dim, longest, np.random.default_rng(2), heads)
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert not library.available()
        return
    assert library.available() and cpu_kernels.attention_applies(k, heads, KERNELS)
    out_kernel, text = _attend(layer, x, k, v, batch, KERNELS)
    assert cpu_kernels.ATTENTION_TARGET in text
    assert not re.search(rf"\[2,3,{k.shape[2]},{block_size},{dim}\]\{{[0-9,]+\}} copy\(", text)
    out_xla, text = _attend(layer, x, k, v, batch, XLA)
    assert cpu_kernels.ATTENTION_TARGET not in text
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    a, b = np.asarray(out_kernel, np.float32), np.asarray(out_xla, np.float32)
    np.testing.assert_allclose(a, b, **tol)
    assert np.abs(a).max() > 0.1 and not np.array_equal(a[:, 0], a[:, 3])  # outputs that tell the rows apart


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("rows", [2, 5, 11, 12, 16])
def test_the_product_kernel_multiplies_few_rows_as_the_library_does(rows, dtype, fresh_choice):
    """Where `Forms.rows_kernel_rows` (bfloat16) or `Forms.f32_rows_kernel_rows` (float32) gives the kernel these
    rows, a product of 2-16 rows is its FFI call,
    else XLA's library with the weight on the left; both equal the float64 product to float32 accuracy (an odd
    number of weight rows, so a last block of fewer than 16; widths that are not a multiple of the kernel's vectors
    nor of its packed chunks, and an odd one, which 9-16 rows multiply in the 2-8 rows' form), and the kernel's result
    for a row does not depend on the batch's other rows (bit for bit, among row counts that take the same form)."""
    n = 75
    kx, kw = jax.random.split(jax.random.PRNGKey(rows))
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert not library.available()
        return
    assert library.available()
    for most, k in ((16, 1000 + rows), (0, 1100 + rows)):  # widths of their own: `_products` keeps its trace per shape
        forms = Forms(cpu=True, kernels=True, **{"rows_kernel_rows" if dtype == "bfloat16" else "f32_rows_kernel_rows":
                                                 most})
        product = jax.jit(lambda x, w, forms=forms: dense.dense(x, w, forms))
        x = jax.random.normal(kx, (rows, 1, k), dtype)
        w = jax.random.normal(kw, (n, k), dtype)
        text = product.lower(x, w).as_text()
        assert (cpu_kernels.ROWS_TARGET in text) == bool(most)
        y = np.asarray(product(x, w))
        ref = np.asarray(x, np.float64)[:, 0] @ np.asarray(w, np.float64).T
        assert y.shape == (rows, 1, n) and y.dtype == np.float32
        np.testing.assert_allclose(y[:, 0], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        if most:  # fewer rows of the same form (2-8 rows, 9-16; float32: one form): the same values for them
            fewer = 9 if rows > 8 and dtype == "bfloat16" else 2
            np.testing.assert_array_equal(np.asarray(product(x[:fewer], w)), y[:fewer])


@pytest.mark.parametrize("rows", [3, 12, 16])
def test_the_product_kernel_behind_the_layer_switch_gives_each_layer_its_own_product(rows, fresh_choice):
    """Through `dense_all` on `LayerKernel`s (a switch over the layers, the layer known only on the device), two
    projections of one input: the kernel's rows-major result (no transpose after the switch) and the library's
    (transposed after it: 16 rows) both equal each layer's float64 product, [rows, 1, n_out] each."""
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert not library.available()
        return
    rng = np.random.default_rng(rows)

    def project(forms, x, layer, *ws):
        return dense.dense_all(x, [dense.LayerKernel(tuple(w), layer) for w in (ws[:3], ws[3:])], forms)

    assert library.available()
    for most in (16, 0):
        forms = Forms(cpu=True, kernels=True, rows_kernel_rows=most)
        k = 96 + rows + (0 if most else 2)  # a width of its own: `_weight_left_products` keeps its trace per shape
        x = jnp.asarray(rng.standard_normal((rows, 1, k)), jnp.bfloat16)
        ws = [[jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16) for _ in range(3)] for n in (40, 24)]
        fn = jax.jit(lambda *a, forms=forms: project(forms, *a))  # a function of its own per choice: no trace shared
        assert (cpu_kernels.ROWS_TARGET in fn.lower(x, 1, *ws[0], *ws[1]).as_text()) == bool(most)
        for layer in (0, 2):
            ys = fn(x, layer, *ws[0], *ws[1])
            for y, w in zip(ys, (ws[0][layer], ws[1][layer])):
                ref = np.asarray(x, np.float64)[:, 0] @ np.asarray(w, np.float64).T
                assert y.shape == (rows, 1, w.shape[0]) and y.dtype == jnp.float32
                np.testing.assert_allclose(np.asarray(y)[:, 0], ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_the_measured_products_run_in_turn_each_on_the_rows_the_last_one_left():
    """`tuning._chained`: x += product(x, w)[:, :n_in] / 1024 for each weight in turn, so every product waits for the
    one before (as a decode step's do); the same values as that loop written out."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((12, 8)), jnp.bfloat16) for _ in range(3))
    want = x
    for w in ws:
        want = want + (jnp.einsum("md,vd->mv", want, w, preferred_element_type=jnp.float32)[:, :8] / 1024).astype(
            jnp.bfloat16)
    got = tuning._chained(lambda x, w: dense.library_weight_left(x, w).T)(x, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_rows_the_product_kernel_takes_are_measured_unless_the_environment_says(dtype, fresh_choice):
    """`tuning.rows_kernel_rows` times the kernel against XLA's library form at 4, 8 and 16 rows of 8 matrices (of
    4096 x 1024 in bfloat16, of 2048 x 512 in float32), each product's rows feeding the next's (one result: the rows
    after the last), and takes the counts up to the first where the kernel is not `FEW_ROWS_MARGIN` faster;
    GDN_JAX_BF16_ROWS_KERNEL (GDN_JAX_F32_ROWS_KERNEL) =1 / 0 decides without measuring (16 / none); another value
    is an error naming it; without the kernels, none."""
    variable, shape, _ = tuning.ROWS_KERNEL_MEASURE[dtype]
    fresh_choice.delenv(variable, raising=False)
    if library.compiler() is None:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert tuning.rows_kernel_rows(lambda *a: pytest.fail("measured"), dtype) == 0
        return
    seen = []

    def timer(kernel_seconds):  # rows -> the kernel's time (the library's: 1.0)
        def time_of(fn, x, weights):
            kernel = cpu_kernels.ROWS_TARGET in fn.lower(x, weights).as_text()
            out = jax.eval_shape(fn, x, weights)
            seen.append((x.shape[0], len(weights), weights[0].shape, weights[0].dtype.name, kernel,
                         (out.shape, out.dtype) == (x.shape, x.dtype)))
            return kernel_seconds[x.shape[0]] if kernel else 1.0
        return time_of

    for kernel_seconds, want in (({4: 0.5, 8: 0.9, 16: 1.0}, 8), ({4: 0.97, 8: 0.5, 16: 0.5}, 0),
                                 ({4: 0.5, 8: 0.5, 16: 0.5}, 16), ({4: 0.5, 8: 2.0, 16: 0.5}, 4)):
        seen.clear()
        assert tuning.rows_kernel_rows(timer(kernel_seconds), dtype) == want
        assert {s[1:4] for s in seen} == {(8, shape, dtype)} and all(s[5] for s in seen)
        measured = [4, 8, 16][:[0, 4, 8, 16].index(want) + 1]  # up to the first count the kernel loses at
        assert [s[0] for s in seen] == [r for r in measured for _ in range(2 * tuning.FEW_ROWS_ROUNDS)]
    for value, want in (("1", 16), ("0", 0)):
        fresh_choice.setenv(variable, value)
        assert tuning.rows_kernel_rows(lambda *a: pytest.fail("measured"), dtype) == want
    fresh_choice.setenv(variable, "yes")
    with pytest.raises(ValueError, match=f"{variable} must be one of 0, 1"):
        tuning.rows_kernel_rows(dtype=dtype)
    fresh_choice.setenv(variable, "1")
    fresh_choice.setenv(library.KERNELS_ENV, "0")
    library.available.cache_clear()
    assert tuning.rows_kernel_rows(dtype=dtype) == 0
