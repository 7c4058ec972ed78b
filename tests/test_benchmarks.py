"""benchmarks/: the HLO collective counter on programs with known collectives,
and a smoke run of the whole suite (tiny model, no timing assertions)."""
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from zerojax._plan import hlo
# starts processes (or runs for minutes): the full suite's, not the fast tier's
pytestmark = pytest.mark.slow

N = 8
F32 = 4
MIB = 2 ** 20


def _tables(text):
  """Every markdown table in `text`, as (caption, rows): the caption is the
  last non-blank line before the table, each row a dict from the header's
  cells to its own (stripped of surrounding `**`)."""
  cells = lambda line: [c.strip().strip("*") for c in line.strip()[1:-1].split("|")]
  lines, tables, caption, i = text.splitlines(), [], "", 0
  while i < len(lines):
    if (lines[i].startswith("|") and i + 1 < len(lines)
        and re.fullmatch(r"\|(:?-+:?\|)+", lines[i + 1].strip())):
      head, rows, i = cells(lines[i]), [], i + 2
      while i < len(lines) and lines[i].startswith("|"):
        rows.append(dict(zip(head, cells(lines[i]))))
        i += 1
      tables.append((caption, rows))
      continue
    if lines[i].strip():
      caption = lines[i].strip()
    i += 1
  return tables


def _table(text, column, caption=""):
  """The rows of the one table in `text` with `column` in its header and a
  caption starting with `caption`."""
  (rows,) = [rows for cap, rows in _tables(text)
             if rows and column in rows[0] and cap.startswith(caption)]
  return rows


def _number(cell):
  """The first number in a cell ("≤ 1,234.5" -> 1234.5)."""
  return float(re.search(r"-?[\d,]*\.?\d+", cell).group().replace(",", ""))


def _mesh():
  return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def _compile(fn, in_specs, out_specs, *args):
  mapped = jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs,
                         out_specs=out_specs, check_vma=False)
  return jax.jit(mapped).lower(*args).compile()


def test_one_of_each_collective_exact_counts_and_bytes():
  def fn(shard, full, small):
    gathered = jax.lax.all_gather(shard, "data", tiled=True)     # [8*128]
    scattered = jax.lax.psum_scatter(full, "data", tiled=True)   # [128]
    summed = jax.lax.psum(small, "data")                         # [4, 16]
    return gathered, scattered, summed

  compiled = _compile(fn, (P("data"), P("data"), P("data")),
                      (P(), P("data"), P("data")),
                      jnp.arange(N * 128.0), jnp.ones((N * N * 128,)),
                      jnp.ones((N * 4, 16)))
  report = hlo.count_collectives(compiled)
  assert report.devices == N
  assert report.summary() == {
      "all-gather": {"ops": 1, "count": 1, "bytes": N * 128 * F32,
                     "wire_bytes": 7 * 128 * F32, "in_loop_count": 0},
      "reduce-scatter": {"ops": 1, "count": 1, "bytes": N * 128 * F32,
                         "wire_bytes": 7 * 128 * F32, "in_loop_count": 0},
      "all-reduce": {"ops": 1, "count": 1, "bytes": 4 * 16 * F32,
                     "wire_bytes": 2 * 7 * 8 * F32, "in_loop_count": 0},
  }
  assert report.count() == 3
  assert report.bytes() == 2 * N * 128 * F32 + 4 * 16 * F32
  assert {op.group_size for op in report.ops} == {N}
  assert report.unknown_trip_summary() == {}


def test_lowered_and_text_give_the_same_report():
  def fn(x):
    return jax.lax.all_gather(x, "data", tiled=True)

  mapped = jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P("data"),
                                 out_specs=P(), check_vma=False))
  lowered = mapped.lower(jnp.ones((N * 16,)))
  from_lowered = hlo.count_collectives(lowered)
  from_text = hlo.count_collectives(lowered.compile().as_text())
  assert from_lowered.summary() == from_text.summary()
  assert from_text.bytes("all-gather") == N * 16 * F32


def test_scan_body_collectives_count_once_per_iteration():
  def fn(xs):
    def body(carry, x):
      return carry + jax.lax.psum(x, "data").sum(), None
    return jax.lax.scan(body, jnp.zeros(()), xs)[0]

  compiled = _compile(fn, P(None, "data"), P(), jnp.ones((5, N * 32)))
  report = hlo.count_collectives(compiled)
  (op,) = [op for op in report.ops if op.kind == "all-reduce"]
  assert op.in_loop and op.trips == 5 and op.bytes == 32 * F32
  row = report.summary()["all-reduce"]
  assert row == {"ops": 1, "count": 5, "bytes": 5 * 32 * F32,
                 "wire_bytes": 5 * 2 * 7 * 4 * F32, "in_loop_count": 5}


# Hand-written optimized HLO in the GPU backend's asynchronous forms: each
# start/done pair and the async-wrapped reduce-scatter count once; a variadic
# all-reduce sums its operands; a loop without a known trip count is
# reported apart.
_ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (p0: bf16[64,32]) -> bf16[16,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  ROOT %rs = bf16[16,32]{1,0} reduce-scatter(%p0), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %v = f32[8]{0} get-tuple-element(%state), index=1
  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%v), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %cp-done)
}

%cond (state.1: (s32[], f32[8])) -> pred[] {
  %state.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[32], y: bf16[64,32], z: f32[10], w: s32[6]) -> f32[128] {
  %x = f32[32]{0} parameter(0)
  %y = bf16[64,32]{1,0} parameter(1)
  %z = f32[10]{0} parameter(2)
  %w = s32[6]{0} parameter(3)
  %ag-start = (f32[32]{0}, f32[128]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %ag-done = f32[128]{0} all-gather-done(%ag-start)
  %ar-start = (f32[10]{0}, s32[6]{0}) all-reduce-start(%z, %w), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
  %ar-done = (f32[10]{0}, s32[6]{0}) all-reduce-done(%ar-start)
  %rs-start = ((bf16[64,32]{1,0}), bf16[16,32]{1,0}, u32[]) async-start(%y), calls=%wrapped_reduce_scatter
  %rs-done = bf16[16,32]{1,0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %init = (s32[], f32[8]{0}) tuple(%w, %z)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[128]{0} copy(%ag-done)
}
"""


def test_async_pairs_variadic_ops_and_unknown_loops():
  report = hlo.count_collectives(_ASYNC_HLO)
  assert report.devices == 4
  assert report.summary() == {
      "all-gather": {"ops": 1, "count": 1, "bytes": 128 * F32,
                     "wire_bytes": 128 * F32 * 3 / 4, "in_loop_count": 0},
      "reduce-scatter": {"ops": 1, "count": 1, "bytes": 64 * 32 * 2,
                         "wire_bytes": 64 * 32 * 2 * 3 / 4,
                         "in_loop_count": 0},
      "all-reduce": {"ops": 1, "count": 1, "bytes": 10 * F32 + 6 * 4,
                     "wire_bytes": 2 * (10 * F32 + 6 * 4) / 2,
                     "in_loop_count": 0},
  }
  assert report.unknown_trip_summary() == {
      "collective-permute": {"ops": 1, "bytes_per_iteration": 8 * F32}}
  rs = next(op for op in report.ops if op.kind == "reduce-scatter")
  assert rs.dtypes == ("bf16",) and rs.group_size == 4


@pytest.mark.parametrize("shape, expected", [
    ("f32[]", 4), ("bf16[4,8]{1,0}", 64), ("(f32[2]{0}, s8[3]{0})", 11),
    ("pred[7]", 7), ("f16[<=10]", 20), ("(f32[2], (bf16[2], u64[1]))", 20),
    ("s4[3]", 2),
])
def test_shape_bytes(shape, expected):
  assert hlo.shape_bytes(shape) == expected


def test_text_without_entry_is_refused():
  with pytest.raises(ValueError, match="no ENTRY computation"):
    hlo.count_collectives("HloModule m\n")


def test_abstract_state_is_analysed_like_the_allocated_one():
  # Configs larger than host memory are analysed from abstract states,
  # compiled without LLVM optimisation: same bytes, footprint, collectives.
  from benchmarks import memory, models, variants

  kw = dict(global_batch=8, seq=16, num_devices=N)
  real = variants.build("zero-3", models.CONFIGS["tiny"], **kw)
  abstract = variants.build("zero-3", models.CONFIGS["tiny"],
                            materialize=False,
                            options=memory.analysis_options(), **kw)
  assert real.materialized and not abstract.materialized
  assert abstract.persistent_bytes() == real.persistent_bytes()
  assert (memory.footprint(abstract.compiled()) ==
          memory.footprint(real.compiled()))
  assert (hlo.count_collectives(abstract.compiled()).summary() ==
          hlo.count_collectives(real.compiled()).summary())
  # The sweeps' faster options: the same collectives, buffers within 1 KiB.
  sweep = variants.build("zero-3", models.CONFIGS["tiny"], materialize=False,
                         options=memory.sweep_options(), **kw)
  assert (hlo.count_collectives(sweep.compiled()).summary() ==
          hlo.count_collectives(real.compiled()).summary())
  assert abs(memory.footprint(sweep.compiled())["footprint"] -
             memory.footprint(real.compiled())["footprint"]) <= 1024


def test_smoke_suite_writes_results(tmp_path):
  from benchmarks import run

  status = run.main(["--smoke", "--out", str(tmp_path)])
  names = {p.name for p in tmp_path.iterdir()}
  for suite in ("speed", "memory", "comm"):
    assert f"smoke_{suite}.json" in names
  for plot in ("speed", "memory", "depth", "comm", "chunks"):
    assert f"smoke_{plot}.png" in names
  results = [json.loads((tmp_path / f"smoke_{suite}.json").read_text())
             for suite in ("speed", "memory", "comm")]
  # a missed goal (timing noise decides at these sizes) fails the run
  assert status == (0 if all(met for r in results
                             for _, _, _, met in r["goals"]) else 1)
  result = results[0]
  assert {"models", "goals", "meta"} <= set(result)
  speed, *users = result["models"]
  assert {"setup", "median_s", "ratio_vs_plain_dp",
          "ratio_vs_gspmd_fsdp"} <= set(speed)
  assert speed["ratio_vs_plain_dp"]["plain-dp"] == 1.0
  # the models written as users write them: every variant built and stepped
  # and third-party code where its package is installed (else said so)
  third = (["hf-gpt2-tiny", "hf-llama-tiny"] if "hf-gpt2-tiny" in run.CONFIGS
           else [])
  assert [u["setup"]["config"] for u in users] == ["mlp-tiny",
                                                   "transformer-tiny", *third]
  assert bool(result["meta"].get("third_party")) == (not third)
  goals = {g[0] for g in result["goals"]}
  # every variant of the first user model, stage 3 and plain DP of the rest
  (every, *others) = users
  assert set(every["median_s"]) == set(run.USER_VARIANTS)
  assert set(every["ratio_vs_plain_dp"]) == {"zero-0", "zero-1", "zero-2",
                                             "zero-3", "plain-dp"}
  assert set(every["one_device_ratio"]) == {"1dev-zero-0"}
  config = every["setup"]["config"]
  assert goals >= {f"zero-{s} step time / plain-dp ({config})"
                   for s in range(4)} | {
                       f"1dev-zero-0 step time / 1dev-optax ({config})"}
  for u in others:
    assert set(u["median_s"]) == set(run.SMOKE_VARIANTS)
    assert u["one_device_ratio"] == {}
    assert (f"zero-3 step time / plain-dp ({u['setup']['config']})"
            in goals)
  for u in users:
    assert u["ratio_vs_gspmd_fsdp"] == {}
  memory = json.loads((tmp_path / "smoke_memory.json").read_text())
  rows = memory["rows"]["tiny"]
  assert {r["variant"] for r in rows} == set(speed["median_s"])
  for r in rows:
    assert {"persistent_bytes", "theory_bytes", "footprint", "temp",
            "argument", "output", "alias"} <= set(r)
  assert set(memory["depth_sweep"]) >= {"layers", "footprint", "num_params"}
  comm = json.loads((tmp_path / "smoke_comm.json").read_text())
  assert {r["variant"] for r in comm["rows"]} == set(speed["median_s"])
  for r in comm["rows"]:
    assert {"per_kind", "measured_bytes", "theory_bytes",
            "measured_over_theory"} <= set(r)
  assert {"chunk_size", "chunks", "leaves", "all_gather_ops",
          "reduce_scatter_ops"} <= set(comm["chunk_sweep"][0])
  # the report shows each model's measured numbers, variant by variant
  readme = (tmp_path / "README.md").read_text()
  for model in result["models"]:
    rows = _table(readme, "median step (ms)",
                  caption=f"**{model['setup']['config']}**")
    assert [r["variant"] for r in rows] == list(model["ratio_vs_plain_dp"])
    for r in rows:
      name = r["variant"]
      assert _number(r["median step (ms)"]) == pytest.approx(
          1e3 * model["median_s"][name], abs=0.05)
      assert _number(r["median × plain-dp"]) == pytest.approx(
          model["ratio_vs_plain_dp"][name], abs=5e-4)
      assert _number(r["page faults / step"]) == pytest.approx(
          model["faults_per_step"][name], abs=0.5)
  rows = _table(readme, "persistent MiB", caption="**tiny**")
  assert {r["variant"]: _number(r["persistent MiB"]) for r in rows} == {
      r["variant"]: pytest.approx(r["persistent_bytes"] / MIB, abs=0.005)
      for r in memory["rows"]["tiny"]}
  rows = _table(readme, "measured / theory")
  assert {r["variant"].split(" (")[0]: _number(r["measured / theory"])
          for r in rows} == {r["variant"]: pytest.approx(
              r["measured_over_theory"], abs=5e-4) for r in comm["rows"]}
  rows = _table(readme, "chunk_size")
  assert [(_number(r["chunk_size"]), _number(r["chunks"])) for r in rows] == [
      (c["chunk_size"], c["chunks"]) for c in comm["chunk_sweep"]]
  assert ("Not timed: transformers' Flax GPT-2" in readme) == (not third)
  goals = {r["goal"]: r for r in _table(readme, "goal")}
  assert set(goals) == {g[0] for r in results for g in r["goals"]}
  for what, value, _, met in (g for r in results for g in r["goals"]):
    assert _number(goals[what]["measured"]) == pytest.approx(value, abs=5e-4)
    assert goals[what]["met"] == ("yes" if met else "no")


@pytest.mark.parametrize("config, leaves", [
    ("mlp-tiny", 2 * 6 + 2), ("transformer-tiny", 2 * 12 + 4),
    ("hf-gpt2-tiny", 2 + 2 * 12 + 2), ("hf-llama-tiny", 1 + 2 * 9 + 2)])
def test_user_model_variants_train_the_same_problem(config, leaves):
  """Every variant of a user-written (or third-party) model computes the
  same first loss as plain optax with the same batch: the mesh variants over
  the global batch, the 1-device ones over one device's share."""
  from benchmarks import memory, third_party, user_models, variants

  if config not in {**user_models.CONFIGS, **third_party.CONFIGS}:
    pytest.skip(third_party.missing)
  cfg = {**user_models.CONFIGS, **third_party.CONFIGS}[config]
  kw = dict(global_batch=N, seq=8, num_devices=N,
            options=memory.sweep_options())
  loss = {}
  for name in ("zero-0", "zero-3", "plain-dp", "1dev-zero-0", "1dev-optax"):
    v = variants.build(name, cfg, **kw)
    out = v.run_once()
    loss[name] = float(out["loss"] if isinstance(out, dict) else out)
    if name == "zero-0":   # unrolled: every leaf in one chunk
      assert len(v.layout.leaves) == leaves and len(v.layout.chunks) == 1
    if name == "plain-dp":
      assert cfg.num_params == sum(
          x.size for x in jax.tree_util.tree_leaves(v.state.params))
    v.release()
  for name in ("zero-0", "zero-3"):
    assert loss[name] == pytest.approx(loss["plain-dp"], rel=1e-5)
  assert loss["1dev-zero-0"] == pytest.approx(loss["1dev-optax"], rel=1e-5)


def test_checkpoint_suite_summary_and_report(tmp_path):
  """The checkpoint suite's ratios, goals, table and plot from synthetic
  measurements (the measurements themselves take minutes)."""
  from benchmarks import checkpoint, report

  def row(total, peak, blocking=None, cpu=None):
    return {"total_s": total, "peak_increase": peak, "blocking_s": blocking,
            "state_bytes": 1000, "cpu_s": cpu}

  rows = {"orbax-save": {**row(2.0, 500, 0.5), "first": row(2.0, 600, 0.5)},
          "zerojax-save": {**row(2.2, 900, 0.1), "first": row(8.0, 900, 6.0, 9.5)},
          "orbax-restore": {**row(1.0, 1000), "first": row(2.0, 1000)},
          "zerojax-restore": {**row(1.1, 2000), "first": row(6.0, 2000)}}
  # two rounds of the restore: per-round ratios 0.5 and 1.5 of the second
  # calls, 3.5 and 2.5 of the first; the saves have none
  rows["orbax-restore"]["rounds"] = [
      {**row(1.0, 0), "first": row(2.0, 0)}, {**row(2.0, 0), "first": row(2.0, 0)}]
  rows["zerojax-restore"]["rounds"] = [
      {**row(0.5, 0), "first": row(7.0, 0)}, {**row(3.0, 0), "first": row(5.0, 0)}]
  result = checkpoint.summary("tiny", rows)
  assert result["time_ratio"] == pytest.approx(
      {"save": 1.1, "first save": 4.0, "restore": 1.1, "first restore": 3.0})
  assert result["round_ratios"]["restore"] == pytest.approx([0.5, 1.5])
  assert result["round_ratios"]["first restore"] == pytest.approx([3.5, 2.5])
  assert result["round_ratios"]["save"] == []
  goals = {g[0]: g[3] for g in checkpoint.goal_checks([result])}
  assert goals == {"zerojax save time / plain orbax (tiny)": True,
                   "zerojax first save time / plain orbax (tiny)": False,
                   "zerojax restore time / plain orbax (tiny)": True,
                   "zerojax first restore time / plain orbax (tiny)": False,
                   "zerojax save peak host increase / state bytes (tiny)": True}
  # rounds are averaged field by field
  assert checkpoint._mean([
      {"total_s": 1.0, "blocking_s": None, "kind": "zerojax-save",
       "first": {"total_s": 3.0}},
      {"total_s": 2.0, "blocking_s": None, "kind": "zerojax-save",
       "first": {"total_s": 5.0}}]) == {
           "total_s": 1.5, "blocking_s": None, "kind": "zerojax-save",
           "first": {"total_s": 4.0}}
  with pytest.raises(ValueError, match="unknown measurement 'load'"):
    checkpoint.measure("load", "tiny", str(tmp_path))

  meta = {"jax": "x", "backend": "cpu", "devices": 8, "cpu_count": 2,
          "host_memory_bytes": 2 ** 30, "date": "today"}
  (tmp_path / "smoke_checkpoint.json").write_text(json.dumps(
      {"meta": meta, "configs": [result],
       "goals": checkpoint.goal_checks([result])}))
  report.write(str(tmp_path), "smoke")
  # the report's table holds the measurements above, one row each
  text = (tmp_path / "README.md").read_text()
  table = {r["measurement"]: r for r in _table(text, "measurement")}
  assert set(table) == {"save", "first save", "restore", "first restore"}
  assert {r["model"] for r in table.values()} == {"tiny"}
  numbers = lambda what, *columns: [
      _number(table[what][c]) if table[what][c] else None for c in columns]
  columns = ("zerojax s", "orbax s", "zerojax / orbax", "zerojax CPU s",
             "orbax CPU s", "zerojax blocking s")
  assert numbers("save", *columns) == [2.2, 2.0, 1.1, None, None, 0.1]
  assert numbers("first save", *columns) == [8.0, 2.0, 4.0, 9.5, None, 6.0]
  assert numbers("restore", *columns) == [1.1, 1.0, 1.1, None, None, None]
  assert numbers("first restore", *columns) == [6.0, 2.0, 3.0, None, None, None]
  spread = lambda what: [float(x) for x in table[what]["rounds"].split("–")]
  assert spread("restore") == [0.5, 1.5]
  assert spread("first restore") == [2.5, 3.5]
  assert table["save"]["rounds"] == table["first save"]["rounds"] == ""
  assert [_number(r["state MiB"]) for r in table.values()] == [
      pytest.approx(1000 / MIB, abs=0.005)] * 4
  goals = {r["goal"]: r for r in _table(text, "goal")}
  first_save = goals["zerojax first save time / plain orbax (tiny)"]
  assert _number(first_save["measured"]) == 4.0
  assert _number(first_save["bound"]) == 1.2
  assert first_save["met"] == "no"
  assert (tmp_path / "smoke_checkpoint.png").stat().st_size > 0


def test_gpu_throughput_child_measures_one_variant_and_reports_it(tmp_path):
  """`python -m benchmarks.run --gpu`'s per-variant measurement, run here on
  the CPU devices with the tiny model: no known peak, so no MFU and no goal
  row; the table says so. Its profile summary ranks each trace line's
  events by total time."""
  from benchmarks import gpu, models
  row = gpu._child("zero-3", "tiny", 1, 16, 1, profile=tmp_path / "p.json")
  summary = json.loads((tmp_path / "p.json").read_text())
  lines = [l for p in summary["planes"] for l in p["lines"]]
  assert summary["steps"] == 3 and lines
  for line in lines:
    times = [e["total_ns"] for e in line["top"]]
    assert times == sorted(times, reverse=True)
    assert sum(times) <= line["total_ns"] + 1e-6
  assert any("run_once" in e["name"] and e["count"] == 3
             for l in lines for e in l["top"])    # the three traced steps
  cfg = models.CONFIGS["tiny"]
  tokens = 8 * 16
  assert row["devices"] == 8 and row["step_s"] > 0
  assert row["tokens_per_s"] == pytest.approx(tokens / row["step_s"])
  # the row's model FLOPs per token against XLA's count of a training
  # step's gradient (the unrolled model: XLA counts a loop body once)
  unrolled = cfg.replace(scan=False)
  model = unrolled.make_model()
  batch = unrolled.make_batch(8, 16)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             batch["tokens"][:1])["params"])
  cost = jax.jit(jax.grad(unrolled.make_loss_fn(model))).lower(
      params, batch).compile().cost_analysis()
  xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"] / tokens
  assert (row["tflops_per_s"] * 1e12 * row["step_s"] / tokens ==
          pytest.approx(xla_flops, rel=0.05))
  assert row["mfu"] is None and gpu.goal_checks([row]) == []
  # the unrolled model's prefetch pair: the same model FLOPs, no goal row
  loop = gpu._child("zero-3-unrolled", "tiny", 1, 16, 1)
  assert loop["variant"] == "zero-3-unrolled" and loop["step_s"] > 0
  assert (loop["tflops_per_s"] * loop["step_s"] ==
          pytest.approx(row["tflops_per_s"] * row["step_s"]))
  assert gpu.goal_checks([loop]) == []
  # the tied embedding by vocabulary blocks: the same model FLOPs, within
  # the padding of its last block
  blocked = gpu._child("zero-3-blocked-embed", "tiny", 1, 16, 1)
  assert (blocked["tflops_per_s"] * blocked["step_s"] ==
          pytest.approx(row["tflops_per_s"] * row["step_s"], rel=1e-3))
  assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  # the row says what it ran with, and its goal row names that
  assert (row["config"], row["batch_per_device"], row["seq"]) == ("tiny", 1, 16)
  assert row["xla_flags"] == os.environ.get("XLA_FLAGS", "")
  h100 = dict(row, mfu=0.5)
  [(what, *rest)] = gpu.goal_checks([h100])
  assert what.startswith("zero-3 MFU (einsum attention, cpu, tiny, batch 1")
  assert rest == [0.5, 0.45, True]
  # beside it, the fastest stage-3 variant of the same setting that beats it
  goals = gpu.goal_checks([dict(row, mfu=0.4), dict(loop, mfu=0.46),
                           dict(loop, variant="zero-3-save-dots", mfu=0.42),
                           dict(loop, mfu=0.9, config="other")])
  assert [(g[0].split()[0], *g[1:]) for g in goals] == [
      ("zero-3", 0.4, 0.45, False), ("zero-3-unrolled", 0.46, 0.45, True),
      ("zero-3-unrolled", 0.9, 0.45, True)]   # alone in its setting
  assert "other" in goals[2][0]
  table = gpu.markdown(
      {"setup": {"config": "tiny", "compute": "bf16", "optimizer": "AdamW",
                 "batch_per_device": 1, "seq": 16, "timed_steps": 1},
       "rows": [row, {"variant": "plain-dp", "error": "OOM"}]}, "gpu")
  rows = {r["variant"]: r for r in _table("\n".join(table), "MFU")}
  zero3 = rows["zero-3"]
  assert re.fullmatch(r"8\W+cpu", zero3["device"])   # 8 devices of kind cpu
  assert _number(zero3["step s"]) == pytest.approx(row["step_s"], abs=5e-5)
  assert _number(zero3["tokens/s"]) == pytest.approx(row["tokens_per_s"], abs=0.5)
  assert _number(zero3["TFLOP/s"]) == pytest.approx(row["tflops_per_s"], abs=0.005)
  assert zero3["MFU"] == "—"                          # no known peak
  assert "OOM" in rows["plain-dp"]["device"]


def test_gpu_model_options_compute_the_same_step():
  """The --gpu runs' model options change how, not what: the attention as
  `jax.nn.dot_product_attention` (XLA's; "cudnn" in fp32, as at init, is
  XLA's too), the blocks rematerialised, and the layerwise block's remat
  keeping the matmul outputs (outside a zerojax step it is `nn.remat` with
  that policy) give the einsum attention's loss and gradients."""
  import numpy as np
  from benchmarks import models
  cfg = models.CONFIGS["tiny"]
  batch = cfg.make_batch(2, 16)

  params = jax.jit(lambda t: cfg.make_model().init(jax.random.key(0), t))(
      batch["tokens"][:1])["params"]     # the same tree under every option

  def grads(c):
    loss_fn = c.make_loss_fn(c.make_model())
    return jax.jit(jax.value_and_grad(loss_fn))(params, batch)

  ref = grads(cfg)
  for changes in ({"attention": "xla"}, {"attention": "cudnn"},
                  {"remat": True},
                  {"layerwise": True,
                   "remat_policy": "dots_with_no_batch_dims_saveable"}):
    got = grads(cfg.replace(**changes))
    for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gpu_rows_measured_elsewhere_are_reported_against_their_own_baseline(
    tmp_path):
  """`benchmarks.run --gpu --rows`: rows that `benchmarks/gpu_lease.sh`
  wrote on a lent machine become the results. Ratios are taken against the
  plain-DP row of the same setting (attention, batch, XLA flags, ...); a
  later row of the same setting replaces an earlier one, but a failed row
  replaces no measured one; the run fails its missed MFU goal. Without
  --gpu, --rows is refused."""
  from benchmarks import run
  def row(variant, attention, step_s, mfu):
    return {"variant": variant, "attention": attention, "devices": 1,
            "device_kind": "NVIDIA H100", "jax": "j", "step_s": step_s,
            "tokens_per_s": 8192 / step_s, "tflops_per_s": 400 * mfu,
            "mfu": mfu, "peak_bytes": 2 ** 30, "cpu_count": 16,
            "host_memory_bytes": 2 ** 37, "date": "2026-01-02 03:04:05"}
  first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  first.write_text("\n".join(json.dumps(r) for r in [
      row("plain-dp", "einsum", 0.2, 0.2), row("zero-3", "einsum", 0.3, 0.1),
      row("plain-dp", "cudnn", 0.1, 0.4), row("zero-3", "cudnn", 0.2, 0.3)]))
  flags = "--b=1 --a=2"
  second.write_text("\n".join(json.dumps(r) for r in [
      row("zero-3", "cudnn", 0.12, 0.5),
      {"variant": "plain-dp", "attention": "cudnn", "error": "exit 124",
       "device_kind": "NVIDIA H100"},
      # another batch, and other flags: rows of their own, no plain DP
      dict(row("zero-3", "cudnn", 0.22, 0.55), batch_per_device=32),
      dict(row("zero-3", "cudnn", 0.3, 0.52), xla_flags=flags),
      dict(row("plain-dp-remat", "cudnn", 0.25, 0.5), xla_flags=flags),
      # the same flags in another order: the same setting, a later row
      dict(row("zero-3", "cudnn", 0.2, 0.52), xla_flags="--a=2 --b=1")]))
  out = tmp_path / "out"
  status = run.main(["--gpu", "--rows", str(first), str(second),
                     "--out", str(out)])
  result = json.loads((out / "gpu_throughput.json").read_text())
  got = {(r["variant"], r["attention"], r.get("batch_per_device"),
          r.get("xla_flags")): r for r in result["rows"]}
  assert len(got) == 7
  assert "error" not in got["plain-dp", "cudnn", None, None]
  assert got["zero-3", "cudnn", None, None]["step_vs_plain-dp"] == pytest.approx(1.2)
  assert got["zero-3", "einsum", None, None]["step_vs_plain-dp"] == pytest.approx(1.5)
  assert "step_vs_plain-dp" not in got["zero-3", "cudnn", 32, None]
  assert ("zero-3", "cudnn", None, "--b=1 --a=2") not in got   # replaced
  other = got["zero-3", "cudnn", None, "--a=2 --b=1"]
  assert other["step_s"] == 0.2 and "step_vs_plain-dp" not in other
  assert other["step_vs_plain-dp-remat"] == pytest.approx(0.8)
  goals = [g[:2] for g in result["goals"]]
  assert goals[:2] == [["zero-3 MFU (einsum attention, NVIDIA H100)", 0.1],
                       ["zero-3 MFU (cudnn attention, NVIDIA H100)", 0.5]]
  assert ["zero-3 MFU (cudnn attention, NVIDIA H100, batch 32)", 0.55] in goals
  assert status == 1     # the einsum row misses its goal
  assert result["meta"]["date"] == "2026-01-02 03:04:05"
  readme = (out / "README.md").read_text()
  assert "1 devices, 16 CPU cores, 128 GiB host memory" in readme
  assert (out / "gpu_throughput.png").stat().st_size > 0
  with pytest.raises(SystemExit):
    run.main(["--quick", "--rows", str(first), "--out", str(out)])


def _quick_report(tmp_path, suite: str, result: dict, goals: list) -> str:
  """The README the report writes for one suite's `--quick` result (with
  made-up machine metadata)."""
  from benchmarks import report
  result.update(goals=goals, meta={
      "jax": "x", "backend": "cpu", "devices": 8, "cpu_count": 2,
      "host_memory_bytes": 2 ** 34, "date": "today"})
  with open(tmp_path / f"quick_{suite}.json", "w") as f:
    json.dump(result, f)
  report.write(str(tmp_path), "quick")
  return (tmp_path / "README.md").read_text()


def test_frontends_suite_measures_both_paths_and_reports(tmp_path):
  """The NNX-vs-linen suite on the tiny user models: both paths train the
  same problem with equal persistent bytes, and the report shows them."""
  from benchmarks import frontends
  result = frontends.run("smoke", log=lambda *_: None)
  assert [(r["model"], r["stage"]) for r in result["rows"]] == [
      (m, s) for m in ("mlp-tiny", "transformer-tiny") for s in frontends.STAGES]
  for row in result["rows"]:
    assert row["persistent_bytes"]["nnx"] == row["persistent_bytes"]["linen"] > 0
    assert row["min_ratio"] > 0
    # stage 3 gathers per block in both: NNX's step holds no more than
    # linen's (every block held would be 4 x the blocks' parameters more)
    fp = row["footprint_bytes"]
    assert 0 < fp["nnx"] <= 1.05 * fp["linen"]
  goals = frontends.goal_checks(result)
  assert len(goals) == 3 * len(result["rows"])
  text = _quick_report(tmp_path, "frontends", result, goals)
  assert "NNX front end against linen" in text
  row = next(r for r in result["rows"] if r["stage"] == 3
             and r["model"] == "transformer-tiny")
  assert (f"| transformer-tiny | 3 | {row['ratio']:.3f} | "
          f"{row['min_ratio']:.3f} |") in text
  assert f"| {row['footprint_bytes']['nnx'] / 2 ** 20:,.2f} |" in text
  assert (tmp_path / "quick_frontends.png").exists()


def test_hybrid_suite_classes_bytes_by_axis_and_reports(tmp_path):
  """The hybrid suite on the tiny GPT: 1-D ZeRO-3 sends everything across
  the two simulated nodes; HSDP keeps gathers and reduce-scatters within a
  node and sends only the gradient shards' all-reduce (4Ψ/D) across; hpZ
  sends the secondary partition's gather and the gradient shards'
  reduce-scatter (4Ψ/D each in fp32), with the state over all 8 devices."""
  from benchmarks import hybrid
  result = hybrid.run("smoke", log=lambda *_: None)
  one_d, hsdp = result["rows"]["zero-3 1-D"], result["rows"]["zero-3 HSDP"]
  assert one_d["within"] == {}
  assert hsdp["within"]["all-gather"] == one_d["across"]["all-gather"]
  assert hsdp["within"]["reduce-scatter"] == one_d["across"]["reduce-scatter"]
  across = hybrid.total(hsdp, "across")
  # the gradient shards (4 bytes x Ψ / D) and a few scalars (loss, norm)
  assert 0 <= across - 4 * result["num_params"] / 4 < 64
  hpz = result["rows"]["zero-3 hpZ"]
  assert hpz["within"]["reduce-scatter"] == one_d["across"]["reduce-scatter"]
  psi = result["num_params"]
  assert hpz["across"]["all-gather"] == hpz["across"]["reduce-scatter"]
  assert 0 <= hybrid.total(hpz, "across") - 8 * psi / 4 < 64
  # what a device sends: HSDP's ring all-reduce 2(R-1)/R x 4Ψ/D, hpZ's
  # gather and reduce-scatter (R-1)/R x 8Ψ/D: the same bytes in fp32
  for label in ("zero-3 HSDP", "zero-3 hpZ"):
    assert abs(result["rows"][label]["wire"]["across"] -
               hybrid.inter_node_wire(label, psi, 8, 4)) < 64
  memory = result["memory"]
  assert memory["zero-3 hpZ"]["persistent"] < memory["zero-3 HSDP"]["persistent"]
  goals = hybrid.goal_checks(result)
  assert [g[3] for g in goals[:5]] == [True] * 5, goals
  text = _quick_report(tmp_path, "hybrid", result, goals)
  assert "Hybrid sharding: bytes per mesh axis" in text
  assert "| zero-3 hpZ |" in text and "Step time, hpZ / 1-D" in text
  assert (tmp_path / "quick_hybrid.png").exists()


def test_tp_suite_classes_bytes_by_mesh_axis_and_reports(tmp_path):
  """The tensor-parallel suite on the tiny GPT: zerojax's gathers and
  reduce-scatters run over data and carry Ψ' = Ψ - Ψ_s + Ψ_s/M per model
  device (half the 1-D run's split bytes at M = 2); over model only
  all-reduces of activations, 5 of the block's width per layer (Megatron's
  4 and the rematerialised forward's first) against the jit step's 4;
  nothing but scalars over both axes."""
  from benchmarks import tensor_parallel as tp
  result = tp.run("smoke", log=lambda *_: None)
  rows, psi, psi_s = result["rows"], result["num_params"], result["split_params"]
  assert 0 < psi_s < psi
  zero, jit, one_d = rows["zero-3 TP"], rows["DP + TP (jax.jit)"], rows["zero-3 1-D"]
  assert set(zero["model"]) == set(jit["model"]) == {"all-reduce"}
  # (a scalar or two of the norm may ride with them: newer XLA)
  assert abs(zero["model"]["all-reduce"] / 5 - jit["model"]["all-reduce"] / 4) <= 16
  assert zero["largest_both"] <= 64 and one_d["model"] == {} == jit["both"]
  # the gradient shards: 4 bytes per parameter row a device owns
  psi_eff = psi - psi_s + psi_s / tp.M
  assert abs(zero["data"]["reduce-scatter"] - 4 * psi_eff) <= 4 * 8 * 16
  assert abs(one_d["data"]["reduce-scatter"] - 4 * psi) <= 4 * 8 * 16
  memory = result["memory"]
  assert memory["zero-3 TP"]["persistent"] < memory["DP + TP (jax.jit)"]["persistent"]
  goals = tp.goal_checks(result)
  assert [g[3] for g in goals] == [True] * len(goals), goals
  # the report's second table (the unrolled GPT, measured by --quick only)
  result["unrolled"] = dict(result, config="tiny unrolled")
  text = _quick_report(tmp_path, "tp", result, goals)
  assert "| variant | over data |" in text.split("one module per block")[1]
  assert "Tensor parallelism beside ZeRO: bytes per mesh axis" in text
  assert "| zero-3 TP |" in text and "zero-3 TP / 1-D zero-3" in text
  assert (tmp_path / "quick_tp.png").exists()


def test_quantized_suite_measures_bytes_and_quality_and_reports(tmp_path):
  """The quantized suite's smoke run: the quantized collectives' bytes are
  the stated formula's (from the plain program's ops), the example trains
  quantized and unquantized, and the report shows both."""
  from benchmarks import quantized
  result = quantized.run("smoke", log=lambda *_: None)
  rows = result["communication"]["rows"]
  assert "s8" in rows["qwZ int8 + qgZ int8"]["all-gather"]["dtypes"]
  assert "u8" in rows["qwZ int8 + qgZ int4"]["all-to-all"]["dtypes"]
  assert "reduce-scatter" not in rows["qwZ int8 + qgZ int4"]
  goals = quantized.goal_checks(result)
  assert [g[3] for g in goals[:3]] == [True] * 3, goals
  runs = result["quality"]["runs"]
  assert set(runs) == {"plain", "block 256"} and len(runs["plain"]) == 20
  assert result["quality"]["seed_spread"] == 0.0   # one seed in smoke
  assert all(math.isfinite(r["loss"]) for run in runs.values() for r in run)
  text = _quick_report(tmp_path, "quantized", result, goals)
  assert "ZeRO++ quantized collectives" in text and "| block 256 |" in text
  assert (tmp_path / "quick_quantized.png").exists()


@pytest.mark.parametrize("text,groups", [
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,2,2]T(1,0,2)", [[0, 1], [4, 5], [2, 3], [6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['replica'=2,'data'=4] {'data'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['replica'=2,'data'=4] {'replica'}",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['replica'=2,'data'=4] {'replica','data'}",
     [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=2,'c'=2]", [list(range(8))]),
    ("channel_id=3", [list(range(8))]),
])
def test_replica_groups_in_every_form(text, groups):
  """The forms XLA prints replica groups in: explicit, iota (with and
  without a transpose), and (newer XLA) named mesh axes, with or without
  the axes; none given is all devices. A group's members are read as the
  partition ids they name (their order within a group aside)."""
  got = hlo.replica_groups(f"channel_id=1, {text}, use_global_device_ids=true", 8)
  assert sorted(map(sorted, got)) == sorted(map(sorted, groups))


def test_disk_suite_measures_bytes_and_depth_and_reports(tmp_path):
  """The disk suite's smoke run (stage 3 bf16, the tiny transformer): per
  parameter per step 4 B of gradient to host under both tiers; to the
  device the gathers' shards, the fp32 master's under the host tier, the
  bf16 copy's (half) under the disk tier; 24 B of master and adam
  statistics read and written by the disk tier, and 8 B of gradient
  (written by the step's sink, read by the stream); its step keeping only
  the bf16 copy in host memory (2 of the host tier's 12 B), its stream
  counted in its host bytes, and on the device no more than the host
  tier's (the gradient shards leave as they are reduced); one allocated
  step at its depth; the report and the plot."""
  from benchmarks import disk
  result = disk.run("transformer-tiny", batch=8, seq=16, n=8,
                    speed_config="transformer-tiny", speed_batch=8,
                    speed_seq=16, rounds=1, cases=("3 bf16",))
  x = result["cases"]["3 bf16"]
  host, on_disk = x["rows"]["host"], x["rows"]["disk"]
  for row in (host, on_disk):
    assert row["pcie_to_host"] == 4.0
  assert host["pcie_to_device"] == 2 * on_disk["pcie_to_device"] > 0
  assert host["disk_bytes_per_param"] == 0 and host["stream"] == 0
  assert on_disk["disk_bytes_per_param"] == 32.0 and on_disk["stream"] > 0
  assert on_disk["step_host"] * 6 == host["step_host"]
  assert on_disk["device"] <= host["device"]
  assert x["largest"]["host"]["layers"] == result["layers"]   # by definition
  assert math.isfinite(x["largest"]["disk"]["loss_of_one_step"])
  goals = disk.goal_checks(result)
  assert [g[1] for g in goals] == [x["size_ratio"]]
  text = _quick_report(tmp_path, "disk", result, goals)
  assert "Disk tier against host offload" in text and "| disk |" in text
  assert (tmp_path / "quick_disk.png").exists()


def test_host_memory_counts_what_malloc_keeps_for_reuse():
  """The allocation check's available memory is the kernel's MemAvailable
  plus what this process freed but glibc's malloc keeps. Under the pooled
  allocator the suites run with (`allocator.ALLOCATOR_TUNABLES`), a freed 512
  MiB buffer stays in the process, and the sum stays where it was (the
  kernel's figure alone drops by the buffer)."""
  import os
  import subprocess
  import sys
  from benchmarks import allocator
  # MemAvailable is the whole machine's: another process (the suite's other
  # worker) allocating at the same moment moves it, so three tries, of
  # which the least disturbed must hold
  code = ("import numpy as np; from benchmarks import memory as m\n"
          "for _ in range(3):\n"
          "  b = m.host_memory()['MemAvailable']; k = m._kept_by_malloc()\n"
          "  x = np.ones(2 ** 26); x[::512] = 2.0; del x\n"
          "  print(b, k, m.host_memory()['MemAvailable'], m._kept_by_malloc())")
  root = os.path.join(os.path.dirname(__file__), os.pardir)
  out = subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                       capture_output=True, text=True,
                       env={**os.environ, "GLIBC_TUNABLES":
                            allocator.ALLOCATOR_TUNABLES}).stdout.splitlines()
  tries = [tuple(map(int, line.split())) for line in out]
  before, kept_before, after, kept_after = tries[0]
  assert kept_after - kept_before > 2 ** 28      # the buffer, kept
  moved = [abs(after - before) for before, _, after, _ in tries]
  assert min(moved) < 2 ** 27, tries


def test_spearman_ranks_with_ties_at_their_mean_rank():
  from benchmarks.plan import spearman
  assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): 0.9487
  assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(
      3 / 10 ** 0.5, rel=1e-6)


def test_plan_suite_labels_and_reports_each_problem(tmp_path):
  from benchmarks import plan as suite
  from zerojax._plan import costmodel
  rows = [{"problem": p, "candidate": costmodel.label(f), "fields": f,
           "device_bytes": 2 ** 20 * (4 - f["stage"]), "host_bytes": 0,
           "wire_bytes": 2 ** 20, "pcie_bytes": 0, "host_update_bytes": 0,
           "flops": 1e9, "modelled_s": 0.1 + f["stage"] / 100,
           "measured_s": 0.2 + f["stage"] / 100 * (1 if p == "a" else -1)}
          for p in ("a", "b") for f in ({"stage": s} for s in range(4))]
  planning = {"problem": "a", "budget": 3 * 2 ** 20, "chosen": "stage 3",
              "candidates": 5, "plan_s": 20.0, "compile_s": 4.0,
              "ratio": 5.0, "table": "zerojax.plan: stage 3"}
  text = suite.write(rows, planning, str(tmp_path),
                     {"date": "today", "jax": jax.__version__, "rounds": 3,
                      "figures": {}, "problems": {"a": "one", "b": "two"}})
  assert "| Spearman, modelled vs measured step time, a (4 candidates) | " \
         "1.00 | >= 0.80 | yes |" in text
  assert "step time, b (4 candidates) | -1.00 | >= 0.80 | no |" in text
  assert "(5 candidates compiled) | 5.00 | <= 10 | yes |" in text
  assert "- a: one" in text
  assert {p.name for p in tmp_path.iterdir()} == {"plan.md", "plan.json",
                                                    "plan.png"}


def test_first_step_goals_compare_growth_and_leaf_scaling(tmp_path):
  from benchmarks import first_step as suite
  row = lambda case, size, shard, first, plain: {
      "case": case, "size": size, "shard_s": shard, "first_step_s": first,
      "plain_first_step_s": plain, "ratio": first / plain}
  rows = [row("hf-gpt2", 12, 2.0, 6.0, 3.0), row("hf-gpt2", 24, 4.0, 15.0,
                                                 6.0),
          row("leaves", 100, 1.0, 2.0, 1.0), row("leaves", 1600, 12.0, 20.0,
                                                 4.0)]
  got = {g: (round(v, 3), met) for g, v, _, met in suite.goals(rows)}
  assert got["first step / plain jit's, hf-gpt2 12"] == (2.0, False)
  # 15 / 6 = 2.5x against plain's 2x
  assert got["growth 12 -> 24 blocks / plain jit's growth"] == (1.25, False)
  # 12 / 1600 a leaf against 1 / 100: 0.75x, linear or better
  assert got["shard seconds a leaf, 1600 / 100 leaves"] == (0.75, True)
  assert got["shard of 1600 leaves, s"] == (12.0, False)
  text = suite.write(rows, str(tmp_path), {"date": "today",
                                           "jax": jax.__version__})
  assert "| leaves | 1600 | 12.0 | 20.0 | 4.0 | 5.00 |" in text
  assert (tmp_path / "first_step.png").exists()


def test_chunked_attention_is_causal_attention():
  """`models.chunked_attention` (the long-sequence model's) against jax's
  dot_product_attention: values and gradients, one block and several."""
  import numpy as np
  from benchmarks.models import chunked_attention
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 64, 4, 16)), jnp.float32)
             for _ in range(3))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()
  grads = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(
      *a, is_causal=True)), argnums=(0, 1, 2))(q, k, v)
  for chunk in (16, 64):
    np.testing.assert_allclose(chunked_attention(q, k, v, chunk), want,
                               atol=2e-6)
    got = jax.grad(loss(lambda *a: chunked_attention(*a, chunk)),
                   argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, grads):
      np.testing.assert_allclose(g, w, atol=5e-5)
  with pytest.raises(ValueError, match="60 tokens.*16"):
    chunked_attention(q[:, :60], k[:, :60], v[:, :60], 16)


def test_long_sequence_goals_read_the_longest_fit(tmp_path):
  from benchmarks import long_sequence as suite
  row = lambda config, seq, temp, step, fits=True: {
      "config": config, "seq": seq, "footprint": temp + 10, "temp": temp,
      "host_temp": 0, "fits": fits, "memory": 100, "time_s": step,
      "compute_s": step, "exposed_s": 0.0, "exposed_fraction": 0.0,
      "compile_s": 1.0}
  rows = [row("gspmd-fsdp (full remat)", 2048, 40, 1.0),
          row("gspmd-fsdp (full remat)", 4096, 95, 2.0, fits=False),
          row("zero-3 remat=dots", 2048, 30, 0.9),
          row("zero-3 remat=dots", 4096, 60, 1.8),
          row("zero-3 remat=full", 4096, 20, 2.4),
          row("zero-3 remat=offload", 4096, 23, 1.9)]
  assert suite.longest(rows, "zero-3 remat=dots")["seq"] == 4096
  assert suite.longest(rows, "gspmd-fsdp (full remat)")["seq"] == 2048
  got = {g: (v, met) for g, v, _, met in suite.goals(rows)}
  assert got["at 4096 tokens (the longest 'dots' fits): offload's device "
             "temporaries / full's"] == ("1.15", True)
  assert got["at 4096 tokens: offload's modelled step / dots'"] == ("1.06",
                                                                    True)
  assert got["2048 tokens: zerojax's fastest that fits / GSPMD FSDP's "
             "(modelled step)"] == ("0.90", True)
  assert got["longest sequence zerojax fits / the longest plain DP or "
             "GSPMD FSDP fits"] == ("4096 / 2048", True)
  text = suite.write(rows, str(tmp_path), {"date": "today",
                                           "jax": jax.__version__})
  assert "| zero-3 remat=dots | 4096 | 1.800 |" in text
  assert (tmp_path / "long_sequence.png").exists()


def test_make_tx_refuses_an_optimizer_it_does_not_know():
  from benchmarks import models
  assert models.make_tx("adafactor") is models.make_tx("adafactor")
  with pytest.raises(ValueError, match="make_tx\\('adafacter'\\).*adafactor"):
    models.make_tx("adafacter")


def test_optimizer_goals_compare_each_optimizer_with_its_own_fsdp(tmp_path):
  from benchmarks import optimizers as suite
  rows = []
  for tx, zero_s, persistent in (("adamw", 1.0, 105), ("muon", 1.3, 108),
                                 ("adafactor", 1.1, 120)):
    rows += [{"optimizer": tx, "variant": "zero-3", "step_s": zero_s,
              "steps": 8, "persistent": persistent, "ideal": 100,
              "shaped": 2, "chunks": 5},
             {"optimizer": tx, "variant": "gspmd-fsdp", "step_s": 1.0,
              "steps": 8}]
  got = {(tx, g): (round(v, 3), met) for tx, g, v, _, met in suite.goals(rows)}
  assert got["muon", "stage-3 step / GSPMD FSDP's"] == (1.3, False)
  assert got["adafactor", "stage-3 step / GSPMD FSDP's"] == (1.1, True)
  assert got["adafactor", "persistent / ((master + state) / N)"] == (1.2, False)
  text = suite.write(rows, str(tmp_path), {"date": "today",
                                           "jax": jax.__version__})
  assert "| muon | zero-3 | 1,300.0 | 0.00 | 2 of 5 |" in text
  assert (tmp_path / "optimizers.png").exists()
