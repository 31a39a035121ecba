"""Step-level batching (rl/batching.py): batched trajectories are the unbatched ones.

The model is the shipped tiny SD3 base (``model.path = "builtin"``) with a LoRA adapter, loaded
once per module; the last step is the base model's tail, so staggered fragments mix adapter states.
Tolerances: float32 CPU kernels round a row differently depending on how many rows share
the matmul, so batched and one-fragment-at-a-time trajectories agree to ``ATOL`` (observed
2.4e-6 in latents, 1.2e-7 in log-probs after 4 steps), not bit for bit; log-probs likewise to ``LP_ATOL``.
"""

from __future__ import annotations

import pytest
import torch

from digenrl.config import ConfigError, ModelConfig, load_config
from digenrl.models.registry import build_model
from digenrl.rl.batching import CondCache, StepBatcher, cond_bytes
from digenrl.rl.sampler import rollout, seeded_generators
from digenrl.rl.sde import sde_step, sigma_schedule

ATOL = 1e-5
LP_ATOL = 1e-5
STEPS = 4
GROUP = 2


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(path="builtin", lora_rank=2), seed=0)


def _cfg(*sets: str):
    return load_config(None, [f"sampler.num_steps={STEPS}", "train.prompts_per_step=4",
                              f"train.group_size={GROUP}", "runtime.fragments_per_step=4", "sampler.base_tail=1",
                              "model.lora_rank=2", *sets])


FRAGMENTS = [(["a red circle"], [11, 12]), (["two blue squares"], [21, 22]),
             (["a green triangle"], [31, 32]), (["a red circle"], [41, 42])]


def _unbatched(model, cfg, prompts, seeds, sde_steps):
    with torch.no_grad():
        cond = model.encode_prompts(prompts).copy()
    from digenrl.models.base import cond_repeat
    cond = cond_repeat(cond, GROUP)
    return list(rollout(model, cond, generator=seeded_generators(seeds), sampler_cfg=cfg.sampler,
                        sde_steps=sde_steps))


def _batched(model, cfg, max_batch, *, stagger: int, cache: CondCache | None = None):
    """Run FRAGMENTS through one batcher, fragment n joining after n * stagger steps."""
    b = StepBatcher(model, cfg.sampler, max_batch=max_batch, cond_cache=cache)
    records: dict[int, list] = {n: [] for n in range(len(FRAGMENTS))}
    waiting = list(enumerate(FRAGMENTS))
    tick = 0
    while waiting or len(b):
        while waiting and waiting[0][0] * stagger <= tick:
            n, (prompts, seeds) = waiting.pop(0)
            b.add(n, b.encode(prompts, GROUP), seeds, {0, 1})
        for key, rec, _ in b.step():
            records[key].append(rec)
        tick += 1
    return b, records


@pytest.fixture(scope="module")
def reference(model):
    cfg = _cfg()
    return [_unbatched(model, cfg, p, s, {0, 1}) for p, s in FRAGMENTS]


@pytest.mark.parametrize("stagger", [0, 1])
def test_batched_trajectories_equal_unbatched_ones(model, reference, stagger):
    cfg = _cfg()
    b, records = _batched(model, cfg, max_batch=8, stagger=stagger, cache=CondCache(1 << 20))
    for n, ref in enumerate(reference):
        got = records[n]
        assert [r.index for r in got] == [r.index for r in ref]  # every step, in order
        for r, e in zip(got, ref, strict=True):
            assert r.sde == e.sde and r.sigma == e.sigma and r.sigma_next == e.sigma_next
            torch.testing.assert_close(r.x_t, e.x_t, atol=ATOL, rtol=0)
            torch.testing.assert_close(r.x_next, e.x_next, atol=ATOL, rtol=0)
            torch.testing.assert_close(r.log_prob, e.log_prob, atol=LP_ATOL, rtol=0)
    # staggered arrivals put fragments at different timesteps in one forward
    assert b.stats.forwards < sum(len(r) for r in reference)
    assert b.stats.rows_per_forward > GROUP


def test_first_ratio_at_k0_is_one_when_the_trainer_recomputes_a_batched_step(model):
    """The trainer recomputes the log-prob of a stored step with its own (unbatched) forward;
    with the same weights (K = 0) the ratio exp(new - old) is 1 within the stated tolerance."""
    cfg = _cfg()
    _, records = _batched(model, cfg, max_batch=8, stagger=1)
    sig = sigma_schedule(STEPS, cfg.sampler.shift).tolist()
    for n, (prompts, _) in enumerate(FRAGMENTS):
        from digenrl.models.base import cond_repeat
        with torch.no_grad():
            cond = cond_repeat(model.encode_prompts(prompts), GROUP)
        for rec in records[n]:
            if not rec.sde:
                continue
            with torch.no_grad():
                v = model.velocity(rec.x_t, torch.full((GROUP,), rec.sigma), cond)
                new = sde_step(cfg.sampler.sde_type, rec.x_t, v, rec.sigma, rec.sigma_next,
                               noise_level=cfg.sampler.noise_level, eta=cfg.sampler.eta,
                               sigma_max=sig[1], x_next=rec.x_next).log_prob
            ratio = torch.exp(new - rec.log_prob)
            torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-3, rtol=0)


def test_a_fragment_waits_until_its_rows_fit(model):
    cfg = _cfg()
    b = StepBatcher(model, cfg.sampler, max_batch=4)
    for n in range(3):
        b.add(n, b.encode(FRAGMENTS[n][0], GROUP), FRAGMENTS[n][1], {0})
    first = b.step()
    assert [k for k, _, _ in first] == [0, 1] and b.rows_in_flight == 4 and len(b.pending) == 1
    steps = 1
    while len(b):
        keys = [k for k, _, _ in b.step()]
        steps += 1
        if 2 in keys:
            break
    assert steps == STEPS + 1  # fragment 2 joined the step after 0 and 1 finished
    with pytest.raises(ValueError, match="max_batch = 4"):
        b.add(9, b.encode(["x", "y", "z"], GROUP), list(range(6)), {0})


def test_cond_cache_reuses_rows_and_evicts_least_recent_by_bytes(model):
    cache = CondCache(1 << 30)
    a = cache.encode(model, ["one", "two", "one"])
    with torch.no_grad():
        ref = model.encode_prompts(["one", "two", "one"])
    for k in ref:  # encoded one by one vs in a batch: same rows (fixed-length padding)
        torch.testing.assert_close(a[k], ref[k], atol=1e-6, rtol=0)
    assert cache.statistics()["misses"] == 2 and cache.statistics()["hits"] == 1
    row = cond_bytes({k: v[:1] for k, v in a.items()})
    small = CondCache(2 * row)
    small.encode(model, ["one"])
    small.encode(model, ["two"])
    small.encode(model, ["one"])  # "two" is now the least recent
    small.encode(model, ["three"])
    st = small.statistics()
    assert st["rows"] == 2 and st["evictions"] == 1 and st["bytes"] <= 2 * row
    small.encode(model, ["one"])
    assert small.statistics()["hits"] == 2  # "one" survived, "two" went


def test_max_batch_below_one_fragment_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as err:
        _cfg("sampler.max_batch=1")
    assert "sampler.max_batch = 1" in str(err.value) and "\n" not in str(err.value)
    assert _cfg("sampler.max_batch=2").sampler.max_batch == 2
    assert _cfg().sampler.max_batch == 0  # off by default


@pytest.mark.slow
def test_a_launch_with_step_batching_trains_the_same_update_as_one_fragment_at_a_time(tmp_path):
    """GAP 4 fragments at K = 0 on one rollout, with and without sampler.max_batch: the rollout
    streams the same chunks (up to batch rounding), so the trained weights agree to 1e-5."""
    from digenrl.config import resolve_mode
    from digenrl.launch import launch, make_run_dir
    from digenrl.telemetry.trace import read_trace
    from tests.conftest import SMALL, final_weights

    runs, shared, occupancy = {}, {}, {}
    # the batched run beats often enough for a 2-step run's occupancy to reach the coordinator
    # join = "fits": the fragments share forwards whatever this machine's step times say
    batched = ["sampler.max_batch=8", 'sampler.join="fits"', "sampler.cond_cache_mb=16", "runtime.heartbeat_s=0.05",
               "runtime.heartbeat_misses=400"]
    for name, extra in (("one", []), ("batched", batched)):
        cfg = resolve_mode(load_config(None, [*SMALL, "run.steps=2", "train.prompts_per_step=4",
                                              "runtime.fragments_per_step=4", "runtime.staleness=0",
                                              *extra]), "digenrl")
        run_dir = make_run_dir(cfg, str(tmp_path / name))
        summary = launch(cfg, run_dir)
        acc = summary["accounting"]
        assert acc["in_flight"] == 0 and acc["discarded"].get("stale", 0) == 0
        runs[name] = final_weights(run_dir)
        # a shared forward is recorded once per fragment it stepped: the same span, twice
        _, spans = read_trace(run_dir / "trace.json")
        steps = [(x.start, x.end) for x in spans if x.name == "denoise_step" and x.node.startswith("rollout")]
        shared[name] = len(steps) - len(set(steps))
        occupancy[name] = summary["batch_rows_per_forward"]
        if name == "batched":  # the run's occupancy, and the batching curve a calibration fits
            from digenrl.sim.calibrate import calibrate

            curve = calibrate(run_dir, warmup_steps=0)["batch_curve"]
            assert curve and all(int(rows) % GROUP == 0 for rows in curve)
    assert shared["one"] == 0 and shared["batched"] > 0
    # a fragment is 2 rows; some forwards carried two fragments, none more than max_batch
    assert occupancy["one"] == {} and GROUP < occupancy["batched"]["rollout-0"] <= 8
    assert runs["one"].keys() == runs["batched"].keys()
    for k in runs["one"]:
        torch.testing.assert_close(runs["batched"][k], runs["one"][k], rtol=0, atol=1e-5, msg=k)


def test_a_compile_failure_falls_back_to_eager_and_logs_the_reason(model):
    """An unknown backend fails at torch.compile: the batcher runs eager (bit-exact with the
    uncompiled one: same process, same inputs, same code path) and says why, once."""
    from digenrl.rl.batching import Denoiser

    told: list[tuple[str, dict]] = []
    den = Denoiser(model, compile=True, max_rows=8, backend="no-such-backend",
                   log=lambda event, **kw: told.append((event, kw)))
    assert den.compiled is None and "no-such-backend" in den.fallback
    assert len(told) == 1 and told[0][0] == "compile_fallback" and "no-such-backend" in told[0][1]["reason"]
    cfg = _cfg()
    b = StepBatcher(model, cfg.sampler, max_batch=8, denoiser=den)
    e = StepBatcher(model, cfg.sampler, max_batch=8)
    for bb in (b, e):
        bb.add(0, bb.encode(FRAGMENTS[0][0], GROUP), FRAGMENTS[0][1], {0, 1})
    while len(b):
        (_, r1, _), (_, r2, _) = b.step()[0], e.step()[0]
        assert torch.equal(r1.x_next, r2.x_next) and torch.equal(r1.log_prob, r2.log_prob)


def test_compile_config_needs_the_step_batcher():
    with pytest.raises(ConfigError, match=r"sampler\.compile = true"):
        _cfg("sampler.compile=true")
    assert _cfg("sampler.compile=true", "sampler.max_batch=4").sampler.compile


def test_rows_are_padded_to_power_of_two_buckets():
    from digenrl.rl.batching import bucket
    assert [bucket(r, 8) for r in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert bucket(6, 6) == 6 and bucket(7, 5) == 7


def test_bucketed_rows_compile_once_per_bucket_as_fragments_come_and_go(model):
    """A counting dynamo backend (graphs traced, run as traced: no inductor, so cheap): with
    fragments of 2 rows joining every other step and leaving after 4, the forward sees 2 and
    4 rows, and dynamo traces a graph per shape and adapter state, not per step."""
    import torch._dynamo

    from digenrl.rl.batching import Denoiser

    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(example_inputs[0].shape if example_inputs else None)
        return gm.forward

    cfg = _cfg()
    den = Denoiser(model, compile=True, max_rows=6, backend=counting)
    records = 0
    b = StepBatcher(model, cfg.sampler, max_batch=6, denoiser=den)
    waiting = list(enumerate(FRAGMENTS))
    tick = 0
    while waiting or len(b):
        if waiting and tick % 2 == 0:
            n, (prompts, seeds) = waiting.pop(0)
            b.add(n, b.encode(prompts, GROUP), seeds, {0, 1})
        records += len(b.step())
        tick += 1
    assert den.fallback == "" and records == len(FRAGMENTS) * STEPS
    # 13 forwards of 2 or 4 rows (the last step, the base model's tail, apart: adapter off);
    # graphs: one per (bucket, adapter state) seen: 2 on, 4 on, 2 off
    assert b.stats.forwards == 13 and sorted(g[0] for g in graphs) == [2, 2, 4]


@pytest.mark.slow  # ~75 s on a 2-core CPU: inductor compiles the tiny transformer
def test_the_compiled_batcher_on_cpu_inductor_matches_eager(model):
    """torch.compile with the inductor backend on this CPU: fused kernels round differently,
    so the compiled trajectory agrees with the eager one to 1e-4."""
    import torch._dynamo

    from digenrl.rl.batching import Denoiser

    torch._dynamo.reset()
    cfg = _cfg()
    den = Denoiser(model, compile=True, max_rows=2)
    b = StepBatcher(model, cfg.sampler, max_batch=2, denoiser=den)
    e = StepBatcher(model, cfg.sampler, max_batch=2)
    for bb in (b, e):
        bb.add(0, bb.encode(FRAGMENTS[0][0], GROUP), FRAGMENTS[0][1], {0, 1})
    while len(b):
        (_, r1, _), (_, r2, _) = b.step()[0], e.step()[0]
        assert den.fallback == ""
        torch.testing.assert_close(r1.x_next, r2.x_next, atol=1e-4, rtol=0)


def test_the_step_engine_streams_each_fragment_in_order_and_a_halted_one_stops_alone(model):
    """The rollout's StepEngine on a real compute thread: three fragments join (the third two
    steps late), fragment 1 is halted after its first chunk; 0 and 2 get every trained step's
    chunk in order, equal to the unbatched records, and a result; 1 gets None and stops."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from digenrl.actors.stepengine import StepEngine
    from digenrl.rl.fragment import FragmentJob
    from digenrl.transport.staging import DeviceToHost

    cfg = _cfg("sampler.max_batch=8", 'sampler.join="fits"')  # joins whatever the step times
    pool = ThreadPoolExecutor(max_workers=1)

    async def go():
        loop = asyncio.get_running_loop()
        # the compute thread starts once fragments 0 and 1 are both queued, so they share their
        # first step whatever the machine's load (a thread that started early would take 0 alone)
        both = threading.Event()

        def gated(fn):
            both.wait()
            return fn()
        engine = StepEngine(model=model, cfg=cfg, submit=lambda name, fn: loop.run_in_executor(pool, gated, fn),
                            stager=DeviceToHost("cpu"), clock=lambda: 0, span="denoise_step")
        queues = {n: asyncio.Queue() for n in range(3)}
        rows: dict[int, list] = {n: [] for n in range(3)}  # (span, rows its step carried) handed
        halts = {n: threading.Event() for n in range(3)}
        futs = {}

        def join(n):
            prompts, seeds = FRAGMENTS[n]
            job = FragmentJob(model=model, cfg=cfg, prompts=prompts, seeds=seeds, sde_steps=[0, 1],
                              trained_steps=[0, 1], reward_fn=None)
            def hand(item, q=queues[n]):
                if item is not None:
                    rows[n].append((item[0], item[4]))
                if n == 1 and item is not None and item[3] is not None:
                    halts[1].set()  # as a Revoke would, deterministically right after its first chunk
                loop.call_soon_threadsafe(q.put_nowait, item)
            futs[n] = engine.join(n, job, nan=False, halt=halts[n], finish=lambda j, images: j.finish(images), hand=hand)
        join(0)
        join(1)
        both.set()
        chunks: dict[int, list] = {0: [], 1: [], 2: []}

        async def drain(n):
            while (item := await queues[n].get()) is not None:
                if item[3] is not None:
                    index, _, _, staged = item[3]
                    await staged.wait_ready()
                    chunks[n].append((index, [t.clone() for t in staged.tensors]))
                    staged.release()
                    if n == 0 and index == 1 and 2 not in futs:
                        join(2)  # two steps late: it joins the batch at the next step
                        joined.set()
        joined = asyncio.Event()
        drains = [asyncio.create_task(drain(n)) for n in (0, 1)]
        await joined.wait()
        drains.append(asyncio.create_task(drain(2)))
        await asyncio.gather(*drains)
        results = {n: await f for n, f in futs.items()}
        await engine.wait_idle()
        return chunks, results, engine, rows

    chunks, results, engine, rows = asyncio.run(go())
    # fragments 0 and 1 joined together: their first step carried both; a reward is no step
    assert rows[0][0] == rows[1][0] == ("denoise_step", 2 * GROUP)
    assert rows[0][-1] == ("reward", 0) and all(r > 0 for name, r in rows[2] if name == "denoise_step")
    pool.shutdown()
    assert results[1] is None and len(chunks[1]) == 1
    assert engine.in_flight == 0 and len(engine.batcher) == 0
    ref = {n: _unbatched(model, cfg, *FRAGMENTS[n], {0, 1}) for n in (0, 2)}
    for n in (0, 2):
        assert results[n] is not None and results[n].images.shape[0] == GROUP
        assert [i for i, _ in chunks[n]] == [0, 1]
        for (i, (_, x_next, lp)), rec in zip(chunks[n], ref[n][:2], strict=True):
            assert i == rec.index
            torch.testing.assert_close(x_next, rec.x_next, atol=ATOL, rtol=0)
            torch.testing.assert_close(lp, rec.log_prob, atol=LP_ATOL, rtol=0)


def test_fragments_arriving_together_are_encoded_in_one_call_and_finishing_together_decoded_in_one(model):
    """encode_many / decode_many: one encoder call and one decoder call for several fragments,
    each fragment's share equal to its own encode (1e-6) and decode (uint8, at most 1 apart:
    the decoder's batch-size rounding)."""
    cfg = _cfg()
    b = StepBatcher(model, cfg.sampler, max_batch=8)
    calls = {"encode": 0, "decode": 0}
    enc, dec = model.encode_prompts, model.decode

    def counted(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    lists = [p for p, _ in FRAGMENTS]
    own = [b.encode(p, GROUP) for p in lists]
    finals = [torch.randn(GROUP, *model.latent_shape, generator=torch.Generator().manual_seed(n)) for n in range(3)]
    alone = [dec(x) for x in finals]
    model.encode_prompts, model.decode = counted("encode", enc), counted("decode", dec)
    try:
        many = b.encode_many(lists, GROUP)
        images = b.decode_many(finals)
    finally:
        del model.encode_prompts, model.decode
    assert calls == {"encode": 1, "decode": 1}
    for got, ref in zip(many, own, strict=True):
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=0, msg=k)
    for got, ref in zip(images, alone, strict=True):
        assert got.shape == ref.shape and got.dtype == torch.uint8
        assert (got.int() - ref.int()).abs().max() <= 1


def test_the_step_curve_leaves_out_warm_up_takes_medians_and_interpolates():
    from digenrl.rl.batching import StepCurve

    c = StepCurve(keep=3)
    c.record(2, 9.0)  # the first step at 2 rows: warm-up, not kept
    assert c.seconds(2) is None
    for t in (1.0, 5.0, 1.2, 1.1):  # the last 3 kept: median 1.2
        c.record(2, t)
    assert c.seconds(2) == pytest.approx(1.2)
    assert c.seconds(1) is None and c.seconds(4) is None  # below the smallest; one point: no line
    c.record(6, 0.0)
    c.record(6, 2.8)
    assert c.seconds(4) == pytest.approx(2.0)  # between 2 and 6 rows
    assert c.seconds(10) == pytest.approx(4.4)  # past the largest, along the last segment


def _curve(b: StepBatcher, seconds: dict[int, float]) -> None:
    for rows, t in seconds.items():
        b.curve.record(rows, t)  # warm-up
        b.curve.record(rows, t)


@pytest.mark.parametrize(("curve", "joins"), [
    ({2: 1.0, 4: 1.1, 8: 1.3}, True),   # a forward of few rows leaves the device idle: join
    ({2: 1.0, 4: 2.0, 8: 4.0}, False),  # time per row flat: the second fragment waits its turn
])
def test_with_join_pays_a_fragment_joins_only_where_the_measured_curve_says_it_pays(model, curve, joins):
    from digenrl.rl.batching import RETRY_REFUSED

    cfg = _cfg()
    b = StepBatcher(model, cfg.sampler, max_batch=8, join="pays")
    _curve(b, curve)
    for n, (prompts, seeds) in enumerate(FRAGMENTS[:2]):
        b.add(n, b.encode(prompts, GROUP), seeds, {0, 1})
    b.curve.record = lambda rows, seconds: None  # type: ignore[method-assign]  # keep the curve as set
    keys = [[k for k, _, _ in b.step()] for _ in range(2)]
    if joins:
        assert keys == [[0, 1], [0, 1]] and b.stats.joins_refused == 0
    else:  # fragment 1 waits while fragment 0 runs, then runs alone: every step one fragment
        assert keys == [[0], [0]] and b.stats.joins_refused == 2
        steps = [[k for k, _, _ in b.step()] for _ in range(2 * STEPS)]
        assert [k for ks in steps for k in ks] == [0] * (STEPS - 2) + [1] * STEPS
        assert b.stats.rows_per_forward == GROUP
    if not joins:  # a refused join is tried again at the RETRY_REFUSED-th refusal in a row
        assert b.stats.joins_refused == STEPS  # one a step while fragment 0 ran
        tries = [b.pays(2, 2) for _ in range(RETRY_REFUSED - STEPS)]
        assert tries == [False] * (RETRY_REFUSED - STEPS - 1) + [True]


def test_with_join_pays_a_row_count_not_measured_yet_is_tried(model):
    cfg = _cfg()
    b = StepBatcher(model, cfg.sampler, max_batch=8, join="pays")
    assert not b.pays(2, 2)  # nothing measured: the 2 rows in flight step alone, and so are measured
    _curve(b, {2: 1.0})
    assert b.pays(2, 2)  # 4 rows not measured yet: tried
    _curve(b, {4: 2.0})
    assert not b.pays(2, 2)  # measured: no saving
    with pytest.raises(ValueError, match="join = 'sometimes': expected 'fits' or 'pays'"):
        StepBatcher(model, cfg.sampler, max_batch=8, join="sometimes")
