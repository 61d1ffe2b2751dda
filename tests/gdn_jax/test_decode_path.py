"""The decode step's CPU-specific paths compute what the plain ones do: rows a few at a time (attention, GDN state
advanced in its pool, the restore read from the source slot) and the single-row product of bfloat16 weights."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.model import attention
from gdn_jax.model import dense
from gdn_jax.backends.cpu import kernels as cpu_kernels, tuning
from gdn_jax.config import EngineConfig, get_preset
from gdn_jax.model.forms import Forms
from gdn_jax.model.state import Batch, DeviceState, init_state
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import restore_linear_state_slots
from gdn_jax.worker.worker import Worker
from gdn_jax.worker.memory import plan_memory
from scheduler import LinearStateCacheOp, SamplingParams, ScheduledSequence, StepPlan
from scheduler.sampling_params import MAX_LOGPROBS

pytestmark = pytest.mark.model

BS, NB, SLOTS = 16, 3, 8


def _random_state(cfg, seed):
    """Pools full of distinct values, so a row that reads the wrong slot or position shows."""
    st = init_state(cfg, 1 + 4 * NB, BS, SLOTS)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    fill = lambda p: jax.random.normal(next(keys), p.shape, p.dtype)  # noqa: E731
    return DeviceState(*(fill(pool) for pool in (st.k, st.v, st.conv, st.ssm)))


def _per_layer(state):
    """Every layer's pools, each with its slot (GDN) or block (KV) axis first: [KV k..., KV v..., conv..., ssm...]."""
    return ([state.k[:, j].swapaxes(0, 1) for j in range(state.k.shape[1])]
            + [state.v[:, j].swapaxes(0, 1) for j in range(state.v.shape[1])] + list(state.conv) + list(state.ssm))


@pytest.mark.parametrize("T", [pytest.param(1, marks=pytest.mark.xla_forms), 16])
def test_rows_a_few_at_a_time_equal_all_rows_at_once(monkeypatch, T):
    """Four rows (one restoring from slot 6, two continuing, one padding row), decode and prefill: one row per loop
    iteration gives the logits and pools of one iteration for all rows, and both equal the previous design, a
    separate copy of the source into the live slot followed by a forward that reads the live slots. (The CPU forms,
    the kernels where they load, as the engine's.)"""
    forms = tuning.product_forms(jnp.float32)
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    rng = np.random.default_rng(T)
    start = np.array([20, 9, 30, 0], np.int32)
    lengths = np.array([T, T, T // 2 + 1, 0], np.int32)
    tables = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], np.int32)
    pos = start[:, None] + np.arange(T)[None, :]
    slots = np.where(np.arange(T)[None, :] < lengths[:, None],
                     np.take_along_axis(tables, np.minimum(pos // BS, NB - 1), 1) * BS + pos % BS, 0)
    batch = Batch(tokens=jnp.asarray(rng.integers(4, 500, (4, T)), jnp.int32), start_pos=jnp.asarray(start),
                  lengths=jnp.asarray(lengths), block_tables=jnp.asarray(tables),
                  slot_mapping=jnp.asarray(slots, jnp.int32), linear_state_ids=jnp.asarray([1, 2, 3, 0], jnp.int32),
                  has_initial_state=jnp.asarray([True, True, True, False]),
                  initial_state_ids=jnp.asarray([6, 2, 3, 0], jnp.int32))
    results = []
    for budget in (1 << 30, 1):  # all rows in one iteration; one row per iteration
        monkeypatch.setitem(attention.CPU_ROWS_BYTES, "attention", budget)
        monkeypatch.setitem(attention.CPU_ROWS_BYTES, "gdn_decode", budget)
        step = jax.jit(lambda p, b, s: forward(graphdef, p, b, s, forms=forms))  # a fresh trace under this budget
        results.append(jax.device_get(step(params, batch, _random_state(cfg, 0))))
    (l1, s1), (l2, s2) = results
    np.testing.assert_allclose(l1[:3], l2[:3], atol=1e-5)
    for a, b in zip(_per_layer(s1), _per_layer(s2)):
        np.testing.assert_allclose(a[1:], b[1:], atol=1e-5)  # slot / block 0 is the padding sink
    before = _random_state(cfg, 0)
    copied, warm = restore_linear_state_slots(before, batch.linear_state_ids, jnp.asarray([True, False, False, True]),
                                              jnp.asarray([6, -1, -1, -1], jnp.int32))
    assert np.asarray(warm).tolist() == np.asarray(batch.has_initial_state).tolist()
    plain = dataclasses.replace(batch, initial_state_ids=None)  # reads the live slots, as before the fold
    l3, s3 = jax.device_get(jax.jit(lambda p, b, s: forward(graphdef, p, b, s, forms=forms))(params, plain, copied))
    np.testing.assert_allclose(l1[:3], l3[:3], atol=1e-5)
    for x, y in zip((s1.conv, s1.ssm), (s3.conv, s3.ssm)):
        np.testing.assert_allclose(x[:, 1:4], y[:, 1:4], atol=1e-5)
    for x, y in zip((s1.conv, s1.ssm), jax.device_get((before.conv, before.ssm))):
        np.testing.assert_array_equal(x[:, 6], y[:, 6])  # the restore source is read, never written


def _worker(cfg, graphdef, params, dtype: str, **settings) -> Worker:
    """A promote-mode worker of 16-token blocks, a 64-token context and 32-token strides, its pools as given."""
    config = EngineConfig.create(dtype=dtype, block_size=16, max_model_len=64, chunk_stride=32,
                                 checkpoint_mode="promote", **settings)
    return Worker(cfg, graphdef, params, plan_memory(cfg, config), config)


def _row(tokens, start, op, seq_id=1, table=(1, 2, 3, 4)):
    slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
    # every row asks for its top logprobs: the tests compare them (a step where no row asks computes none)
    return ScheduledSequence(seq_id, tokens, start, list(table), slots, op, True,
                             SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS), 0)


def _materialised_shapes(hlo: str) -> set[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every fusion, convert and copy result outside fused computations: what the step writes to
    memory (a convert inside a fusion is computed element by element, in registers)."""
    found, fused = set(), False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation's header: fused ones are called by fusion instructions
            fused = line.startswith("%fused") or "_computation" in line.split("(")[0]
        m = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (fusion|convert|copy)\(", line)
        if m and not fused:
            found.add((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return found


@pytest.mark.parametrize("rows, k, cap, faster", [
    (dense.UPCAST_ROWS - 1, 256, None, True), (dense.UPCAST_ROWS, 256, None, True),
    (dense.UPCAST_ROWS, 320, 96 * 320 * 4 - 1, True), (dense.UPCAST_ROWS, 192, None, False)])
def test_many_row_bfloat16_products_multiply_in_float32(monkeypatch, rows, k, cap, faster):
    """From `UPCAST_ROWS` rows on (prefill) a bfloat16 product converts its operands to float32 and multiplies in
    float32 where that routine is the faster (`Forms.bf16_upcast`, measured by `tuning.upcast_is_faster`: a CPU
    without fast bfloat16 products); with fewer rows, a weight whose float32 copy would pass `UPCAST_MAX_BYTES`, or a
    CPU whose bfloat16 routine is the faster, the weight is multiplied as it is. Either way the result equals the
    float64 product to float32 accuracy."""
    forms = Forms(cpu=True, bf16_upcast=faster)
    if cap is not None:  # (a width of its own: `_products` keeps its trace per shape)
        monkeypatch.setattr(dense, "UPCAST_MAX_BYTES", cap)
    n = 96
    kx, kw = jax.random.split(jax.random.PRNGKey(rows))
    x = jax.random.normal(kx, (1, rows, k), jnp.bfloat16)
    w = jax.random.normal(kw, (n, k), jnp.bfloat16)
    step = jax.jit(lambda x, w: dense.dense(x, w, forms))
    y = np.asarray(step(x, w))
    ref = np.asarray(x, np.float64)[0] @ np.asarray(w, np.float64).T
    assert y.shape == (1, rows, n) and y.dtype == np.float32
    np.testing.assert_allclose(y[0], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    written = _materialised_shapes(step.lower(x, w).compile().as_text())
    assert (("f32", (n, k)) in written) == (rows >= dense.UPCAST_ROWS and cap is None and faster), written


def test_the_faster_many_row_form_is_measured_unless_the_environment_says(monkeypatch):
    """`upcast_is_faster` times both forms of a prefill-sized bfloat16 product (off the caller's trace) and picks the
    faster; GDN_JAX_BF16_UPCAST=1 / 0 decides without measuring; another value is an error naming the variable."""
    monkeypatch.delenv(tuning.UPCAST_ENV, raising=False)
    seen = []

    def timer(conversion_first):
        def time_of(fn, x, w):
            jaxpr = str(jax.make_jaxpr(fn)(x, w))
            seen.append((x.dtype, w.shape, "convert_element_type" in jaxpr))
            return 1.0 if ("convert_element_type" in jaxpr) == conversion_first else 2.0
        return time_of

    for conversion_first in (True, False):
        assert tuning.upcast_is_faster(timer(conversion_first)) is conversion_first
    assert sorted(seen)[0][:2] == (jnp.bfloat16, (2048, 1024)) and {c for _, _, c in seen} == {True, False}
    _environment_decides(monkeypatch, tuning.upcast_is_faster, tuning.UPCAST_ENV)
    assert tuning.UPCAST_ENV == "GDN_JAX_BF16_UPCAST"


def _environment_decides(monkeypatch, choice, variable: str):
    """`choice` (a measured choice, undecorated) returns what `variable` says, "1" or "0", without measuring; another
    value is an error naming the variable."""
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv(variable, value)
        assert choice(lambda *a: pytest.fail("measured")) is want
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match=f"{variable} must be one of 0, 1"):
        choice()


@pytest.mark.parametrize("library", [True, False])
def test_one_row_bfloat16_product_takes_the_measured_form(monkeypatch, library):
    """A one-row bfloat16 product is multiplied as two rows (the row and a zero row) with the weight on the left
    where `Forms.few_rows_weight_left` says the library is faster, else as XLA's loop over the weight (`one_row`); it
    equals the float64 product to float32 accuracy either way. (The library's form: the few-row kernel off.)"""
    forms = Forms(cpu=True, few_rows_weight_left=library)
    n, k = 80, (328 if library else 344)  # widths of their own: `_products` keeps its trace per shape
    kx, kw = jax.random.split(jax.random.PRNGKey(k))
    x = jax.random.normal(kx, (1, 1, k), jnp.bfloat16)
    w = jax.random.normal(kw, (n, k), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w: dense.dense(x, w, forms))(x, w))
    ref = np.asarray(x, np.float64)[0] @ np.asarray(w, np.float64).T
    assert y.shape == (1, 1, n) and y.dtype == np.float32
    np.testing.assert_allclose(y[0], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    jaxpr = str(jax.make_jaxpr(lambda x, w: dense.dense(x, w, forms))(x, w))
    assert ("concatenate" in jaxpr) == library  # the zero row
    assert (f"f32[{n},2] = dot_general" in jaxpr) == library  # W @ x.T of the two rows


def test_the_faster_few_row_form_is_measured_unless_the_environment_says(monkeypatch):
    """`few_rows_weight_left` times a one-row bfloat16 product as XLA's loop (at both vector widths) and as two rows
    with the weight on the left, off the caller's trace, and picks the library form only when it is faster by
    `FEW_ROWS_MARGIN`; GDN_JAX_BF16_FEW_ROWS_WEIGHT_LEFT=1 / 0 decides without measuring; another value is an error
    naming the variable."""
    monkeypatch.delenv(tuning.FEW_ROWS_ENV, raising=False)
    seen = []

    def timer(library_seconds):
        def time_of(fn, x, weights):
            library = "concatenate" in fn.lower(x, weights).as_text()
            seen.append((x.shape, x.dtype.name, len(weights), weights[0].shape, library))
            return library_seconds if library else 1.0
        return time_of

    for library_seconds, want in ((0.5, True), (0.97, False), (2.0, False)):
        assert tuning.few_rows_weight_left(timer(library_seconds)) is want
    assert {s[:4] for s in seen} == {((1, 1024), "bfloat16", 8, (4096, 1024))}
    # per round: the loop at both widths, then the library form
    assert [s[4] for s in seen[:3]] == [False, False, True] and len(seen) == 3 * 3 * tuning.FEW_ROWS_ROUNDS
    _environment_decides(monkeypatch, tuning.few_rows_weight_left, tuning.FEW_ROWS_ENV)
    assert tuning.FEW_ROWS_ENV == "GDN_JAX_BF16_FEW_ROWS_WEIGHT_LEFT"


def test_the_faster_decode_vector_width_is_measured_unless_the_environment_says(monkeypatch):
    """`decode_vector_bits` runs the one-row product compiled at 256 and at 512 bits in turn and takes 512 only when
    the median round is at least DECODE_VECTOR_MARGIN faster with it (one fast round decides nothing, a tie keeps
    256); GDN_JAX_DECODE_VECTOR_BITS=256 / 512 decides without measuring; another value is an error naming it."""
    monkeypatch.delenv(tuning.DECODE_VECTOR_BITS_ENV, raising=False)
    rounds = tuning.DECODE_VECTOR_ROUNDS
    for ratios, want in (([0.8] * rounds, 512), ([0.97] * rounds, 256), ([1.0] * rounds, 256),
                         ([1.6] * rounds, 256), ([0.5] + [1.0] * (rounds - 1), 256), ([1.6] + [0.9] * (rounds - 1), 512)):
        seen, ratio = [], iter(ratios)

        def timer(bits, fn, x, weights):
            seen.append((bits, x.shape, x.dtype, len(weights), weights[0].shape, weights[0].dtype))
            return 1.0 if bits == 256 else next(ratio)

        assert tuning.decode_vector_bits("bfloat16", Forms(cpu=True), timer) == want, ratios
        assert seen[:2] == [(bits, (1, 1024), jnp.bfloat16, 8, (4096, 1024), jnp.bfloat16) for bits in (256, 512)]
        assert len(seen) == 2 * rounds
    monkeypatch.setattr(tuning, "choices_file", lambda cache=None: None)  # nothing kept from another start
    monkeypatch.setattr(tuning, "_measured", {})  # nor from earlier in this process
    assert tuning.decode_vector_bits("float32") in (256, 512)  # the real probe compiles and runs
    for value in ("256", "512"):
        monkeypatch.setenv(tuning.DECODE_VECTOR_BITS_ENV, value)
        assert tuning.decode_vector_bits("float32", timer=lambda *a: pytest.fail("measured")) == int(value)
    monkeypatch.setenv(tuning.DECODE_VECTOR_BITS_ENV, "1024")
    with pytest.raises(ValueError, match="GDN_JAX_DECODE_VECTOR_BITS must be one of 256, 512"):
        tuning.decode_vector_bits("float32")


@pytest.mark.parametrize("width", [64, 4096])
def test_single_row_bfloat16_decode_reads_the_weights_as_they_are(width):
    """A one-row bfloat16 decode step multiplies every projection matrix without converting it: no float32 copy of
    a matrix is written (XLA's library path converts the whole weight first, on every step: ~3x the time), and its
    logits are those of the same row in a two-row step (the library's product) up to float32 summation order. At
    width 4096 the products whose input is that wide take the two-row form (`dense.one_row`)."""
    cfg = dataclasses.replace(get_preset("tiny-random"), hidden_size=width)
    graphdef, params = init_model(cfg, dtype=jnp.bfloat16)
    w = _worker(cfg, graphdef, params, "bfloat16", max_num_seqs=2, num_kv_blocks=9, num_linear_slots=4)
    kernels = {tuple(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
               if "kernel" in jax.tree_util.keystr(path)}
    assert len(kernels) >= 4
    written = _materialised_shapes(w.compiled_step((1, 1, w.max_blocks)).as_text())
    assert not {("f32", k) for k in kernels | {k[::-1] for k in kernels}} & written  # a copy, or a transposed one
    # the contraction written without the transpose (the library's path) does write one: the check can fail
    k = next(leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if "kernel" in jax.tree_util.keystr(path))
    library = jax.jit(lambda x, k: jnp.einsum("...d,vd->...v", x, k, preferred_element_type=jnp.float32))
    hlo = library.lower(jnp.ones((1, 1, k.shape[1]), jnp.bfloat16), k).compile().as_text()
    assert ("f32", tuple(k.shape)) in _materialised_shapes(hlo)

    prompt = np.random.default_rng(0).integers(4, 500, 20).tolist()
    rows = [lambda tokens, start, fresh: _row(tokens, start, LinearStateCacheOp(1, fresh, -1)),
            lambda tokens, start, fresh: _row(tokens, start, LinearStateCacheOp(2, fresh, -1), 2, (5, 6, 7, 8))]
    w.execute(StepPlan(True, [row(prompt, 0, True) for row in rows]))  # the same prompt in two sequences
    state = jax.device_get(w.state)
    one = w.execute(StepPlan(False, [rows[0]([7], len(prompt), False)]))
    w.state = jax.device_put(state)
    pair = w.execute(StepPlan(False, [row([7], len(prompt), False) for row in rows]))
    assert one.tokens[0] == pair.tokens[0] == pair.tokens[1]
    # bf16 activations either way; compiled without LLVM's optimisation (`make test`'s model group) XLA rounds every
    # op's output to bfloat16, where its fused code keeps some in float32: 3.3e-2 seen there, 2e-2 otherwise
    np.testing.assert_allclose(one.top_logprobs[0], pair.top_logprobs[0], atol=5e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n, k", [(64, 1024), (33, 1024), (64, 4096), (40, 6144)])
def test_one_row_product_streams_the_weight_at_any_width(dtype, n, k):
    """The one-row product (decode at batch 1) equals the float64 product and writes no float32 copy of the weight:
    XLA fuses the product into a loop over the weight only while it is under 4096 wide, and from there on would
    compile a transposed float32 copy of the whole matrix first (what a 4096-wide model's decode did: 20-50x slower).
    (The product in this machine's CPU forms, `tuning.product_forms`, as the engine's.)"""
    forms = tuning.product_forms(dtype)
    kx, kw = jax.random.split(jax.random.PRNGKey(n + k))
    x = jax.random.normal(kx, (1, 1, k), dtype)
    w = jax.random.normal(kw, (n, k), dtype)
    step = jax.jit(lambda x, w: dense.dense(x, w, forms))
    y = np.asarray(step(x, w))
    ref = np.asarray(x, np.float64).reshape(k) @ np.asarray(w, np.float64).T
    assert y.shape == (1, 1, n) and y.dtype == np.float32
    np.testing.assert_allclose(y.reshape(n), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    written = _materialised_shapes(step.lower(x, w).compile().as_text())
    assert not [s for d, s in written if d == "f32" and np.prod(s) >= n * k], written
    # the product written as it was (x @ w.T) does copy the weight from 4096 columns on: the check can fail
    plain = jax.jit(lambda x, w: jnp.dot(x[0], w.T, preferred_element_type=jnp.float32))
    copies = [s for d, s in _materialised_shapes(plain.lower(x, w).compile().as_text()) if np.prod(s) == n * k]
    assert bool(copies) == (k >= dense.FUSED_MATVEC_COLUMNS)


def _branch_bodies(hlo: str) -> dict[str, str]:
    """The text of every computation that a conditional (`lax.switch`) runs as a branch, by name."""
    names = {n.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", hlo)
             for n in group.split(",")}
    bodies, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            head = line.split(" ")[0].lstrip("%")
            name = head if head in names else None
            if name:
                bodies[name] = ""
        if name:
            bodies[name] += line + "\n"
    return bodies


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows, tokens", [(16, 1), (2, 16)])
def test_layer_switch_branches_generate_no_code(dtype, rows, tokens):
    """The products of few rows that put the weight on the left (16-64 rows, `dense.WEIGHT_LHS_ROWS`) transpose
    their results after the switch over the layers, not inside its branches: a branch is then the library's product
    (or the compiled few-row kernel's call, where this machine measured it faster: `tuning.rows_kernel_rows`) alone,
    with no kernel for XLA to generate per layer and call site (the 128 such kernels of Qwen3.5-9B's 16-row decode
    step took a sixth of its compilation)."""
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg, dtype=dtype)
    w = _worker(cfg, graphdef, params, jnp.dtype(dtype).name, max_num_seqs=16, num_kv_blocks=70, num_linear_slots=33)
    hlo = w.compiled_step((rows, tokens, w.max_blocks)).as_text()
    bodies = _branch_bodies(hlo)
    products = [b for b in bodies.values()
                if " dot(" in b or "__ynn_fusion" in b or "kind=kCustom" in b or cpu_kernels.ROWS_TARGET in b]
    assert len(products) >= 2 * cfg.num_hidden_layers, sorted(bodies)  # several products per layer, one branch each
    generated = {n: b for n, b in bodies.items() if "kind=kLoop" in b or "kind=kInput" in b or "kind=kOutput" in b}
    assert not generated, next(iter(generated.values()))


def _products_reading(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """The dot instructions (library fusions' included) of which an operand is float32 shaped [..., *dims] (unit
    axes aside)."""
    shapes = {m.group(1): (m.group(2), tuple(int(d) for d in m.group(3).split(",") if d and d != "1"))
              for m in re.finditer(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]", hlo)}
    found = []
    for line in hlo.splitlines():
        m = re.search(r" dot\(([^)]*)\)", line)
        operands = [shapes.get(op.strip().lstrip("%"), ("", ())) for op in m.group(1).split(",")] if m else []
        if any(dtype == "f32" and shape[-len(dims):] == dims for dtype, shape in operands):
            found.append(line.strip())
    return found


@pytest.mark.parametrize("rows", [1, 16])
def test_the_decode_rule_reads_the_state_in_one_product(rows):
    """A GDN layer's decode step multiplies each row's state once: its products with k and q are one contraction,
    and the output comes from it, not from the new state (`gated_delta.recurrent_gated_delta_rule`), so the state is
    read by that product and by the update that writes it to its pool, not four times as before."""
    cfg = dataclasses.replace(get_preset("tiny-random"), linear_key_head_dim=24, linear_value_head_dim=40)
    graphdef, params = init_model(cfg)
    w = _worker(cfg, graphdef, params, "float32", max_num_seqs=16, num_kv_blocks=70, num_linear_slots=33)
    hlo = w.compiled_step((rows, 1, w.max_blocks)).as_text()
    products = _products_reading(hlo, (cfg.linear_num_value_heads, 24, 40))
    assert len(products) == 1, products
