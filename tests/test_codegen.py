"""``runtime.codegen``: a compiled program as one generated function, checked against the records it runs."""

from __future__ import annotations

import torch


def test_generated_program_runs_like_the_records():
    """``codegen.generate``: a list argument holding tensors (``cat``), keyword arguments, a tuple
    output read by ``getitem``, a constant output, and every value popped after its last reader."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from runtime.codegen import Layout, generate
    from runtime.program import compile_program, record_target, serialize_graph

    def f(x, w):
        y = torch.cat([x, x * 2], dim=1)
        a, b = torch.split(y @ w, 3, dim=0)
        return a.sum(dim=1, keepdim=True), b, 7

    x, w = torch.randn(6, 4), torch.randn(8, 5)
    gm = make_fx(f)(x, w)
    records = [(op, name, record_target(t) if op == "call_function" else t, a, k, i)
               for op, name, t, a, k, i in serialize_graph(gm)]
    program = compile_program(records, "alpa.grad")
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def layout(st):
        args, kwargs = st.layout()
        if st.target is torch.ops.aten.mul.Tensor:  # a donating call takes (args, kwargs)
            return Layout(lambda a, k: st.target(*a, **k), args, kwargs, donor=True)
        return Layout(st.target._op, args, kwargs)

    def general(st):
        def call(values):
            args, kwargs = st.resolve([values[a] for a in st.inputs])
            return st.target(*args, **kwargs)
        return call

    for direct in (True, False):  # direct kernel calls, and the runner's per-operator fallback
        run = generate(program, layout if direct else (lambda st: None), general, None, None, None)
        env = dict(zip(inputs, (x, w)))
        out = run(env, None)
        want = f(x, w)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and out[2] == 7
        # every value but the outputs, the inputs included, popped after its last reader
        assert set(env) == {a for a in program.steps[-1].target if isinstance(a, str)}


def test_a_watched_value_reaches_its_hook_when_computed():
    """``generate(..., watch=...)``: the hook gets the value right after the step computing it (the
    loss a step answers with early, ``StageRunner._loss_ready``), before any later step runs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from runtime.codegen import generate
    from runtime.program import CALL, compile_program, record_target, serialize_graph

    def f(x):
        loss = (x * 3).sum()
        return loss, torch.exp(x)

    x = torch.randn(4)
    gm = make_fx(f)(x)
    records = [(op, name, record_target(t) if op == "call_function" else t, a, k, i)
               for op, name, t, a, k, i in serialize_graph(gm)]
    program = compile_program(records, "alpa.grad")
    loss = next(st.name for st in program.steps if st.kind == CALL and st.target is torch.ops.aten.sum.default)
    seen = []

    def general(st):
        def call(values):
            seen.append(st.name)
            args, kwargs = st.resolve([values[a] for a in st.inputs])
            return st.target(*args, **kwargs)
        return call

    run = generate(program, lambda st: None, general, None, None, None,
                   watch={loss: lambda v: seen.append(("watched", float(v)))})
    out = run({"x_1": x}, None)
    i = seen.index(loss)
    assert seen[i + 1] == ("watched", float(out[0])) and "exp" in seen[i + 2]


def _program_of(f, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    from runtime.program import compile_program, record_target, serialize_graph

    gm = make_fx(f)(*args)
    records = [(op, name, record_target(t) if op == "call_function" else t, a, k, i)
               for op, name, t, a, k, i in serialize_graph(gm)]
    return compile_program(records, "alpa.grad"), [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def _regions_run(f, args, general_ops=(), cache=None, state=None):
    """``f``'s program generated with compiled regions (their artifacts in the directory ``cache``);
    operators in ``general_ops`` run through the runner's per-operator function (they split the
    program). ``state``: the set of owned state inputs, by position (emptied, then the input names
    put in; ``None``: no state); each output ``k`` of ``f`` is then the new value of input ``k``."""
    from runtime.codegen import Layout, generate
    from runtime.donation import state_overwrites

    program, inputs = _program_of(f, *args)
    writes = owned = None
    if state is not None:
        names = [inputs[k] for k in sorted(state)]
        state.clear()
        state.update(names)
        over = state_overwrites(program, set(names))
        outs = program.steps[-1].target
        writes = {outs[inputs.index(n)]: (n, *over[n]) for n in names if n in over}
        owned = state

    def layout(st):
        if st.target in general_ops:
            return None
        a, k = st.layout()
        return Layout(st.target._op, a, k, op=st.target)

    def general(st):
        def call(values):
            a, k = st.resolve([values[x] for x in st.inputs])
            return st.target(*a, **k)
        return call

    run = generate(program, layout, general, None, None, None, regions=lambda st: True, region_cache=cache,
                   writes=writes, owned=owned)
    return run, inputs, program


def test_a_compiled_region_writes_the_new_state_into_the_old_states_memory():
    """An update (``m = 0.9 m + g``, ``p = p - 0.1 m``): each new value is written into its state
    input's memory (``donation.state_overwrites``), as torch.optim's compiled update does, while the
    runner owns that tensor; else into a copy, and the caller's tensor is left as it was. The values
    equal eager's either way."""
    def update(p, m, g):
        m2 = m * 0.9 + g
        return p - 0.1 * m2, m2

    p, m, g = torch.randn(64, 32), torch.randn(64, 32), torch.randn(64, 32)
    owned = {0, 1}
    run, inputs, _ = _regions_run(update, (p, m, g), state=owned)
    want = update(p, m, g)
    (region,) = run.regions
    mine = set(owned)
    for held in (set(), mine):  # memory the runner does not own (compiled here), then memory it owns
        owned.clear()
        owned.update(held)
        p1, m1 = p.clone(), m.clone()
        out = run(dict(zip(inputs, (p1, m1, g))), None)
        torch.testing.assert_close(out[0], want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out[1], want[1], rtol=0, atol=1e-6)
        assert len(region._writes) == 2
        if held:
            assert out[0] is p1 and out[1] is m1  # written where the old state was
        else:
            assert out[0] is not p1 and out[1] is not m1
            assert torch.equal(p1, p) and torch.equal(m1, m)  # the caller's tensors untouched


def test_a_state_another_value_still_reads_is_not_written_in_place():
    """``p`` is also returned as it was (a value outliving the program shares its memory): the update
    may not overwrite it, and the region computes the new value into memory of its own."""
    def update(p, g):
        return p - 0.1 * g, p.view(-1)

    p, g = torch.randn(16, 8), torch.randn(16, 8)
    owned = {0}
    run, inputs, _ = _regions_run(update, (p, g), state=owned)
    p1 = p.clone()
    out = run(dict(zip(inputs, (p1, g))), None)
    (region,) = run.regions
    assert region._writes == [] and torch.equal(p1, p)
    torch.testing.assert_close(out[0], p - 0.1 * g)


def test_zero_dim_values_a_kernel_reads_are_computed_once():
    """``regions.hoist_scalars``: AdamW's bias correction (``1 - beta ** step``, on the 0-d step count)
    read by the kernel over the parameter becomes an output of the graph (Inductor then computes it
    once, not once per vector of elements inside the kernel's loop); the graph's own outputs are
    unchanged, and an elementwise value of full size is not hoisted."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from runtime.regions import hoist_scalars

    def update(p, m, step, beta):
        step2 = step + 1
        corr = 1 - beta ** step2.to(torch.float64)
        return p - (m / corr.to(torch.float32)) * 0.1, step2

    args = [torch.randn(32, 16), torch.randn(32, 16), torch.tensor(3.0), torch.tensor(0.9)]
    gm = make_fx(update)(*args)
    assert hoist_scalars(gm, args) == 1  # the float32 correction the kernel reads; step2 is an output already
    out = gm(*args)
    assert len(out) == 3 and out[2].dim() == 0
    want = update(*args)
    torch.testing.assert_close(out[0], want[0])
    torch.testing.assert_close(out[1], want[1])


def test_compiled_regions_run_like_the_records():
    """``generate(..., regions=...)``: runs of direct kernels become ``regions.Region``s, split where
    the runner runs an operator itself; the first call runs them as written and compiles them, the
    next runs Inductor's code. Tuple values (``split``'s) cross a region's border as their elements;
    outputs equal eager's and every other value is gone from the environment."""
    def f(x, w):
        y = torch.cat([x, x * 2], dim=1)
        a, b = torch.split(y @ w, 3, dim=0)
        c = torch.relu(a) + 1.0
        return c.sum(dim=1, keepdim=True), torch.tanh(b) * 2.0, 7

    x, w = torch.randn(6, 4), torch.randn(8, 5)
    run, inputs, program = _regions_run(f, (x, w), general_ops=(torch.ops.aten.relu.default,))
    assert len(run.regions) == 2  # the kernels before relu, and after it
    want = f(x, w)
    for _ in range(2):  # as written (and compiled), then compiled
        env = dict(zip(inputs, (x, w)))
        out = run(env, None)
        torch.testing.assert_close(out[0], want[0])
        torch.testing.assert_close(out[1], want[1])
        assert out[2] == 7 and set(env) == {a for a in program.steps[-1].target if isinstance(a, str)}
    assert all(r.compiled is not None and r.failed is None for r in run.regions)


def test_a_compiled_region_frees_an_input_at_its_last_use(tmp_path):
    """An input whose last reader is inside a region is handed to the compiled code, which frees it
    after that use (as eager frees a saved activation during the backward), not when the region
    returns: the region's peak does not hold every input to its end. Compiled here or loaded from
    the cache alike."""
    import weakref

    def f(x):
        return (torch.tanh(x) * 2).sum(dim=0)  # x is read once, first

    x = torch.randn(64, 64)
    for loaded in (False, True):  # the first run compiles and saves, the second loads
        run, inputs, _ = _regions_run(f, (x,), cache=str(tmp_path))
        run(dict(zip(inputs, (x.clone(),))), None)
        (region,) = run.regions
        compiled, events = region.compiled, []

        def watched(args, compiled=compiled, events=events):
            out = compiled(args)
            events.append("returned")
            return out

        region.compiled = watched
        value = x.clone()
        weakref.finalize(value, events.append, "input freed")
        env = dict(zip(inputs, (value,)))
        del value
        torch.testing.assert_close(run(env, None)[0], f(x))
        assert region.loaded == loaded and events == ["input freed", "returned"]


def test_a_region_that_fails_to_compile_runs_as_written(monkeypatch, caplog):
    """Compiling fails (here Inductor is made to raise): the region says why, in one log line, and
    runs its kernels one by one from then on, with the same results."""
    import torch._inductor as inductor

    def refuse(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(inductor, "standalone_compile", refuse)
    x = torch.randn(5, 3)
    run, inputs, _ = _regions_run(lambda x: (torch.sin(x) * x).sum(), (x,))
    with caplog.at_level("WARNING", logger="runtime.regions"):
        for _ in range(2):
            out = run(dict(zip(inputs, (x,))), None)
            torch.testing.assert_close(out[0], (torch.sin(x) * x).sum())
    (region,) = run.regions
    assert region.compiled is None and region.failed == "RuntimeError: no C++ compiler"
    assert [r.getMessage() for r in caplog.records] == [
        "region at step 1 (3 steps) runs uncompiled: RuntimeError: no C++ compiler"]


def test_a_region_ends_at_a_watched_value():
    """The loss a step answers with early is watched: its region ends there and the hook runs before
    the next region (the backward and update) starts."""
    from runtime.codegen import Layout, generate

    def f(x):
        loss = (x * 3).sum()
        return loss, torch.exp(x) * 2

    x = torch.randn(4)
    program, inputs = _program_of(f, x)
    loss = next(st.name for st in program.steps if st.target is torch.ops.aten.sum.default)
    seen = []

    def layout(st):
        a, k = st.layout()
        return Layout(st.target._op, a, k, op=st.target)

    run = generate(program, layout, None, None, None, None, watch={loss: lambda v: seen.append(float(v))},
                   regions=lambda st: True)
    out = run(dict(zip(inputs, (x,))), None)
    assert len(run.regions) == 2 and run.regions[0].outputs == (loss,)
    assert seen == [float(out[0])]


def test_a_region_given_inputs_laid_out_otherwise_compiles_again_once(caplog):
    """Compiled code is specialized on its inputs' strides: an input laid out otherwise compiles the
    region again; layouts that change once more leave it running as written. Results stay right."""
    x = torch.randn(4, 4)
    run, inputs, _ = _regions_run(lambda x: (x * 2).sum(dim=0), (x,))
    (region,) = run.regions
    for value in (x, x.t(), x):
        out = run(dict(zip(inputs, (value,))), None)
        torch.testing.assert_close(out[0], (value * 2).sum(dim=0))
    assert region.compiled is None and region.failed.startswith("inputs laid out differently again")
    column = torch.randn(4, 1)  # a size-1 dimension's stride is free, as the compiled code checks it
    run, inputs, _ = _regions_run(lambda x: (x * 2).sum(dim=0), (column,))
    for value in (column, torch.randn(1, 4).t()):
        torch.testing.assert_close(run(dict(zip(inputs, (value,))), None)[0], (value * 2).sum(dim=0))
    assert not run.regions[0]._relaid and run.regions[0].compiled is not None


def test_compiled_regions_are_saved_and_a_second_run_loads_them(tmp_path, caplog):
    """With a cache directory the first program compiles its region and saves it; the same program
    generated again (a second run of a script) loads it and compiles nothing; an input laid out
    otherwise is another entry; a damaged entry is logged and compiled again. Results stay right."""
    import gc

    from runtime.regions import artifact_key

    def f(x):
        return torch.tanh(x @ x) * 2 + 1

    x = torch.randn(6, 6)

    def one_run(value):
        run, inputs, _ = _regions_run(f, (value,), cache=str(tmp_path))
        for _ in range(2):
            torch.testing.assert_close(run(dict(zip(inputs, (value,))), None)[0], f(value))
        (region,) = run.regions
        assert region.compiled is not None and region.failed is None
        return region

    assert not one_run(x).loaded
    (entry,) = tmp_path.glob("*.bin")
    assert one_run(x).loaded
    assert not one_run(x.t()).loaded and len(list(tmp_path.glob("*.bin"))) == 2
    gm = one_run(x).graph()
    assert entry.name == f"{artifact_key(gm, [x])}.bin" != f"{artifact_key(gm, [x.t()])}.bin"
    gc.collect()  # no region of this process holds the artifact any more: the cache is read again
    entry.write_bytes(b"not an artifact")
    with caplog.at_level("WARNING", logger="runtime.regions"):
        assert not one_run(x).loaded
    assert any("ignoring compiled region" in r.getMessage() for r in caplog.records)
    assert one_run(x).loaded


def test_regions_of_the_same_kernels_on_the_same_layouts_share_one_artifact(tmp_path):
    """Two runs of the same kernels on inputs of one layout (as the update of each parameter of one
    shape, whose gradients are views at different offsets of a bucket's buffer) have the same code
    and key: the first region compiles and saves, the second takes its artifact. Results stay right."""
    def f(x, y):
        a = torch.tanh(x) * 2
        m = torch.relu(y)  # run by the runner: it ends the first region
        return a, torch.tanh(m) * 2

    buf = torch.randn(80)
    x, y = buf[:32].view(4, 8), buf[48:].view(4, 8)  # offsets 0 and 48 floats: both aligned
    run, inputs, _ = _regions_run(f, (x, y), general_ops=(torch.ops.aten.relu.default,), cache=str(tmp_path))
    out = run(dict(zip(inputs, (x, y))), None)
    torch.testing.assert_close(out[0], torch.tanh(x) * 2)
    torch.testing.assert_close(out[1], torch.tanh(torch.relu(y)) * 2)
    first, second = run.regions
    assert first.inputs != second.inputs and first.graph().code == second.graph().code
    assert (first.loaded, second.loaded) == (False, True) and len(list(tmp_path.glob("*.bin"))) == 1
    assert second._artifact is first._artifact  # the live one is taken: not even loaded again


def test_a_graph_pickles_without_naming_the_drivers_script(tmp_path):
    """``program.graph_bytes``: a script that imports ray before torch has itself (``__mp_main__``) first
    among the modules pickle searches for ``torch.preserve_format``; plain pickle (Python 3.11) then
    names the script, which a worker cannot load. Run as a user's script, in a process of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(
        "import ray  # noqa: F401 - first, as in a Ray script\n"
        "import pickle\n"
        "import torch\n"
        "from torch import fx\n"
        "from runtime.program import graph_bytes\n"
        "g = fx.Graph()\n"
        "x = g.placeholder('x')\n"
        "g.output(g.call_function(torch.ops.aten.clone.default, (x,), {'memory_format': torch.preserve_format}))\n"
        "data = graph_bytes(fx.GraphModule({}, g))\n"
        "print(b'main__' in data, pickle.loads(data)[1][4]['memory_format'] is torch.preserve_format)\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
