"""The prepared device check: what DigenRL does on a real GPU, in one JSON.

    python bench/gpu_check.py [--cpu] [--out PATH] [--skip SECTION,... | --only SECTION,...]
    # default PATH: gpu_check.json

Sections (each records its own figures and ``ok``; the script exits 1 if any is not ok). The
JSON is rewritten after every section, so a command killed at its time limit still leaves
what finished:

``build``        torch, its CUDA build, cuDNN and NCCL versions, the device (name, capability,
                 memory), the Python packages DigenRL needs and which are missing.
``nvml``         one real heartbeat reading (:class:`digenrl.telemetry.nvml.GpuProbe`).
``k0_bf16``      ``digenrl launch --mode disagg-sync`` (K = 0): a rollout and a trainer as two
                 processes sharing the GPU, ``model.dtype = bfloat16`` (bf16 compute, float32
                 masters), on a tiny SD3 pipeline folder of the real classes (text encoders and
                 VAE on the GPU too); every step's ``ratio_max_dev`` must be exactly 0.
``transformers`` one denoising step (velocity, no grad) and one training step (LoRA rank 32 on
                 flow_grpo's targets, AdamW over float32 masters) of a random-weight
                 SD3.5-medium (2.5B) and FLUX.1-dev (12B) transformer at 512 and 1024 px, bf16,
                 batch 2: seconds and peak GPU memory; also the first ratio of the trained
                 step, which must be exactly 1 (the same instance recomputes its own sample).
``memory``       one LoRA training step (rank 32, bf16, AdamW over float32 masters) of a
                 random-weight SD3.5-medium and FLUX.1-dev transformer at 512 and 1024 px (2
                 rows) and a Wan2.1-T2V-14B one at 480 x 832 x 81 frames (1 row), built on the
                 device: ``torch.cuda.max_memory_allocated`` beside the plan of the same step
                 traced on the meta device (``digenrl plan --memory``'s trainer terms); an
                 out-of-memory is recorded beside the plan. ``--cpu``: the tiny configs, the plan
                 against the step measured on the CPU (within 10 %) and the meta count of a
                 forward's saved bytes against the CPU's with math attention (equal).
``offload``      ``bench/offload.py``: a bf16 full fine-tune step of a random SD3 transformer
                 (12 blocks, 1536 wide, ~0.35B parameters) with ``model.offload = "optimizer"``
                 against ``"none"``: device bytes per trained parameter (measured), pass and
                 optimizer-step seconds, and the float32 masters after 5 steps each (CPU AdamW
                 on pinned host masters against CUDA AdamW: apart by float32 rounding only).
``staging``      chunks device -> pinned host -> wire -> pinned host -> device through
                 ``transport/staging.py`` and the project's PUSH/PULL sockets: every landed
                 tensor bit-identical to its source (a fresh tensor per chunk, pooled buffers
                 reused only after their send completed), then chunk goodput at 1 MiB and
                 16 MiB a tensor against the bare copies through raw pyzmq
                 (``bench/transport.py``'s ``staged_chunk_goodput``, the same code the CPU bench
                 runs with the CUDA parts off).
``rollout``      ``bench/rollout.py``'s comparison (its ``measure``): four fragments of 1 prompt x 2
                 trajectories, 4 steps, bf16, one at a time through the rollout's FragmentJob
                 vs through one StepBatcher vs the diffusers pipeline's ``__call__``:
                 ``rollout_over_pipeline``, ``batched_over_fragment``, each one's samples/s, the
                 time split and one forward's milliseconds at 1, 2, 4 and 8 rows; on the GPU
                 also ``sampler.join`` "pays" against "fits" (``--join``). The folder:
                 FluxPipeline of the real classes, FLUX.1-dev's transformer geometry (width 3072,
                 24 heads of 128, guidance embedding) cut to 2 double and 4 single blocks
                 (~1.2 B parameters), FLUX's VAE (8x, 16 channels), tiny text encoders of the
                 widths it reads, at 512 px (1024 image tokens); ``--cpu``: the tiny FLUX folder
                 with an 8x VAE at 64 px. ``ok``: every figure finite and positive.
``default_run``  ``digenrl launch`` with the embedded default config (digenrl mode, 500 steps
                 of a LoRA on the shapes judge, 640-sample evaluations at the start and the end)
                 on the GPU: wall, samples/s, accounting, each node's device.

``--cpu`` runs every section that can run without a GPU, at tiny sizes (the transformers
are the tiny configs at 32 and 64 px, the two-process run 2 steps, the default run 1), so it is
tested in the suite (``tests/test_gpu_check.py``, which skips ``default_run``: one more
launch, in digenrl mode as tests/test_launch.py's at smaller settings, and its report is built
by the same ``_run_report`` as ``k0_bf16``'s). Sized to finish in under 8 minutes on one
H200 with no network. Nothing is downloaded: weights are random, folders are built here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

#: SD3.5-medium's transformer/config.json (random weights here).
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
#: FLUX.1-dev's transformer/config.json: FluxTransformer2DModel's defaults plus the guidance
#: embedding (FLUX.1-dev is guidance-distilled: its config has ``guidance_embeds: true``).
FLUX_DEV: dict[str, Any] = {"guidance_embeds": True}
SECTIONS = ("build", "nvml", "k0_bf16", "transformers", "memory", "offload", "staging", "rollout", "default_run")
NEEDED = ["diffusers", "transformers", "peft", "safetensors", "zmq", "msgpack", "structlog", "uvloop", "PIL",
          "pynvml", "tomli_w", "numpy", "matplotlib"]


def _write(out: dict[str, Any], path: Path) -> None:
    """Write the JSON whole (temporary file, then rename): a reader never sees half of it."""
    out["ok"] = all(s.get("ok") for s in out["sections"].values())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(str(path) + ".tmp")
    tmp_out.write_text(json.dumps(out, indent=1, default=str))
    tmp_out.replace(path)


def _section(out: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], path: Path) -> None:
    """Run one section, then rewrite the JSON at ``path``; a failure is recorded (type and
    message) and the next section runs."""
    t0 = time.perf_counter()
    print(f"gpu_check: {name} ...", flush=True)
    try:
        result = fn()
    except Exception as e:  # recorded in the JSON; the check then exits 1
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    out["sections"][name] = result
    print(f"gpu_check: {name} ok={result.get('ok')} ({result['seconds']} s)"
          + (f" {result['error']}" if "error" in result else ""), flush=True)
    _write(out, path)


def build_info(device: torch.device) -> dict[str, Any]:
    missing = []
    versions = {}
    for mod in NEEDED:
        try:
            m = importlib.import_module(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except ImportError:
            missing.append(mod)
    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "device": str(device),
                            "python": sys.version.split()[0], "packages": versions, "missing": missing}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())), bf16=torch.cuda.is_bf16_supported())
    info["ok"] = not missing and (device.type == "cpu" or info["cuda_available"])
    return info


def nvml_reading() -> dict[str, Any]:
    from digenrl.telemetry.nvml import GpuProbe

    reading = GpuProbe().read()
    gpus = reading.get("gpus", [])
    fields = {"mem_used_mb", "mem_free_mb", "mem_total_mb", "util_pct"}
    return {"ok": bool(reading.get("available")) and bool(gpus) and all(fields <= set(g) for g in gpus),
            "reading": reading}


def _launch(args: list[str], run_dir: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "digenrl.cli", "launch", "--run-dir", str(run_dir), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _node_devices(run_dir: Path) -> dict[str, str]:
    """Each node's device, from the 'joined' line of its log."""
    out = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"event": "joined"' in line:
                rec = json.loads(line)
                out[rec.get("node_id", log.stem)] = rec.get("device", "?")
    return out


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's training rows (one per optimizer step); evaluation rows are not steps."""
    from digenrl.telemetry.metrics import is_eval_row

    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [r for r in rows if not is_eval_row(r)]


def k0_bf16(work: Path, steps: int) -> dict[str, Any]:
    from tests.pipelines import MAX_TEXT_TOKENS, write_pipeline_folder

    folder = write_pipeline_folder("sd3", work / "sd3-tiny")
    run_dir = work / "k0"
    proc = _launch(["--mode", "disagg-sync", "--steps", str(steps), "--set", f'model.path="{folder}"',
                    "--set", 'model.dtype="bfloat16"', "--set", f"model.max_text_tokens={MAX_TEXT_TOKENS}",
                    "--set", "train.prompts_per_step=2", "--set", "train.group_size=4",
                    "--set", "run.eval_every=0"], run_dir, 600)  # the ratios, not the evaluation
    report = _run_report(proc, run_dir)
    devs = report["ratio_max_dev"]
    report["ok"] = report["ok"] and report["steps"] == steps and set(devs) == {0.0}
    return report


def _fake_encoder(tokens: int, dim: int, pooled: int, device: torch.device) -> Callable[[Any], dict[str, torch.Tensor]]:
    """Fixed random conditioning of the real encoders' shapes (no 4.7B T5 is built)."""
    gen = torch.Generator().manual_seed(0)
    embeds, pooled_t = torch.randn(1, tokens, dim, generator=gen), torch.randn(1, pooled, generator=gen)

    def encode(prompts: Any) -> dict[str, torch.Tensor]:
        b = len(prompts)
        return {"prompt_embeds": embeds.expand(b, -1, -1).to(device), "pooled_embeds": pooled_t.expand(b, -1).to(device),
                "prompt_mask": torch.ones(b, tokens, dtype=torch.long, device=device)}
    return encode


def transformer_steps(device: torch.device, real: bool) -> dict[str, Any]:
    import diffusers

    from digenrl.config import load_config
    from digenrl.models import families

    cfg = load_config(None, ["train.lr=1e-5", 'train.timesteps="all"', "sampler.num_steps=4",
                             "sampler.base_tail=0"])  # every step trained: none left to the base
    cases = {"sd3": (diffusers.SD3Transformer2DModel, SD35_MEDIUM if real else families.TINY_CONFIGS["sd3"],
                     (333, 4096, 2048) if real else (16, 32, 32)),
             "flux": (diffusers.FluxTransformer2DModel, FLUX_DEV if real else families.TINY_CONFIGS["flux"],
                      (512, 4096, 768) if real else (16, 32, 32))}
    sizes = (512, 1024) if real else (32, 64)
    dtype = torch.bfloat16  # bf16 compute, float32 LoRA masters: the training recipe, also with --cpu
    results: dict[str, Any] = {"real_size": real, "dtype": str(dtype), "batch": 2, "lora_rank": 32, "cases": {}}
    ok = True
    for family, (cls, kwargs, (tokens, dim, pooled)) in cases.items():
        with torch.device(device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # parameters made on the device in bf16: no 48 GB fp32 copy first
            try:
                transformer = cls(**kwargs)
            finally:
                torch.set_default_dtype(prev)
        n_params = sum(p.numel() for p in transformer.parameters())
        spec = families.SPECS[family]
        for px in sizes:
            try:
                results["cases"][f"{family}@{px}"] = case = _one_case(
                    family, spec, transformer, px, real, (tokens, dim, pooled), device, dtype, cfg)
                ok &= case["first_ratio_max_dev"] == 0.0 and not case["skipped"]
            except torch.cuda.OutOfMemoryError as e:
                results["cases"][f"{family}@{px}"] = {"params": n_params, "error": f"out of memory: {e}"[:300]}
                ok = False
            transformer.delete_adapters("default")  # the next size adapts the same transformer afresh
            print(f"gpu_check:   {family} {px}px {results['cases'][f'{family}@{px}']}", flush=True)
        del transformer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["ok"] = ok
    return results


def _one_case(family: str, spec: Any, transformer: torch.nn.Module, px: int, real: bool, text: tuple[int, int, int],
              device: torch.device, dtype: torch.dtype, cfg: Any) -> dict[str, Any]:
    from types import SimpleNamespace

    from digenrl.models import catalog
    from digenrl.models.adapter import LORA_TARGETS
    from digenrl.rl.policy import Policy
    from digenrl.rl.sampler import StepRecord
    from digenrl.rl.sde import sde_step

    vae = SimpleNamespace(config=SimpleNamespace(block_out_channels=(128, 256, 512, 512))) if real else None
    shape = catalog.GEOMETRY[family](transformer.config, vae).latent_shape(px, px)  # real: the pipelines' 8x VAE
    model = spec.adapter(transformer, encoder=_fake_encoder(*text, device), decoder=lambda x: x,
                         latent_shape=shape, lora_rank=32, lora_targets=LORA_TARGETS, dtype=dtype)
    model.guidance = spec.guidance
    policy = Policy(model, cfg.train, cfg.sampler)
    cond = model.encode_prompts(["a", "b"])
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1)).to(device)
    case: dict[str, Any] = {"params": sum(p.numel() for p in transformer.parameters() if not p.requires_grad),
                            "lora_params": sum(p.numel() for p in policy.params), "latent": list(shape)}
    for phase in ("denoise", "train"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        if phase == "denoise":
            with torch.no_grad():
                v = model.velocity(x, torch.full((2,), 0.75, device=device), cond)
                step = sde_step("sde", x, v, 0.75, 0.5, noise_level=0.7, eta=0.3, sigma_max=0.75,
                                generator=torch.Generator().manual_seed(2))
            rec = StepRecord(0, 0.75, 0.5, x, step.x_next, step.log_prob, True)
        else:
            adv = torch.tensor([1.0, -1.0])
            st = policy.fragment_loss_backward({0: rec}, cond, adv, torch.ones(2, dtype=torch.bool),
                                               batch_size_total=2, n_trained_total=1, sigma_max=0.75)
            opt = policy.optimizer_step()
            case.update(first_ratio_max_dev=st["ratio_max_dev"], grad_norm=opt["grad_norm"],
                        skipped=opt["skipped"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            case[f"{phase}_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        case[f"{phase}_s"] = round(time.perf_counter() - t0, 3)
    return case


def _memory_case(family: str, kwargs: dict[str, Any], px: tuple[int, int], frames: int, rows: int, text: tuple[int, int, int],
                 vae: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One LoRA (rank 32) training step of ``rows`` latents: the plan (traced on the meta device,
    what ``digenrl plan --memory`` adds up for a trainer) beside the peak measured on ``device``."""
    from digenrl.models import catalog
    from digenrl.sim.memplan import (
        adapt,
        build_transformer,
        module_bytes,
        trace_training_step,
        training_forward_saved_bytes,
    )

    def step(dev: torch.device) -> tuple[int, Any]:
        torch.manual_seed(0)
        transformer = build_transformer(family, kwargs, dtype, dev)
        shape = catalog.GEOMETRY[family](transformer.config, vae).latent_shape(*px, frames)
        model = adapt(family, transformer, shape, text, lora_rank=32, dtype=dtype)
        if dev.type != "meta":
            from digenrl.sim.memplan import _on
            model.encoder = _on(model.encoder, dev)
        st = trace_training_step(model, rows, foreach=device.type == "cuda",
                                 attention="flash" if dev.type == "meta" else "none")
        return module_bytes(transformer) + st.masters + st.optimizer_state + st.peak, shape

    planned, shape = step(torch.device("meta"))
    case: dict[str, Any] = {"latent": list(shape), "rows": rows, "planned_peak_bytes": planned,
                            "planned_peak_gib": round(planned / 2**30, 3)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        try:
            step(device)
            torch.cuda.synchronize(device)
            measured = torch.cuda.max_memory_allocated(device) - base
            case.update(measured_peak_bytes=measured, measured_peak_gib=round(measured / 2**30, 3),
                        plan_error=round(planned / measured - 1, 4))
        except torch.cuda.OutOfMemoryError as e:
            case["error"] = f"out of memory: {e}"[:300]
        torch.cuda.empty_cache()
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        measured, _ = step(device)  # the same step on real CPU tensors, the CPU's own attention
        case.update(measured_peak_bytes=measured, plan_error=round(planned / measured - 1, 4))
        # the meta count of a forward's saved bytes equals the CPU's with math attention
        kw = dict(transformer_kwargs=kwargs, px=px[0], batch=2, text=text, lora_rank=32, frames=frames)
        case["planned_saved_bytes"] = training_forward_saved_bytes(family, **kw)  # type: ignore[arg-type]
        with sdpa_kernel(SDPBackend.MATH):
            case["measured_saved_bytes"] = training_forward_saved_bytes(family, **kw, device=device)  # type: ignore[arg-type]
    return case


def memory_peaks(device: torch.device, real: bool) -> dict[str, Any]:
    """SD3.5-medium and FLUX.1-dev at 512 and 1024 px (2 rows), Wan2.1-T2V-14B at 480 x 832 x 81
    frames (1 row), random weights built on the device in bf16 (``--cpu``: the tiny configs in
    float32): the plan beside ``torch.cuda.max_memory_allocated`` of one LoRA training step (an
    out-of-memory is recorded beside the plan that predicted it)."""
    from types import SimpleNamespace as NS

    from digenrl.models import catalog, families
    from digenrl.sim.memplan import REAL_TEXT

    kl8 = NS(config=NS(block_out_channels=(128, 256, 512, 512))) if real else None
    wan_vae = NS(config=NS(scale_factor_spatial=8, scale_factor_temporal=4)) if real else None
    dtype = torch.bfloat16 if real else torch.float32
    cases: list[tuple[str, str, dict[str, Any], tuple[int, int], int, int, tuple[int, int, int], Any]] = []
    for family, kwargs in (("sd3", SD35_MEDIUM if real else families.TINY_CONFIGS["sd3"]),
                           ("flux", FLUX_DEV if real else families.TINY_CONFIGS["flux"])):
        for px in ((512, 1024) if real else (32, 64)):
            cases.append((f"{family}@{px}", family, kwargs, (px, px), 0, 2,
                          REAL_TEXT[family] if real else (16, 32, 32), kl8))
    cases.append(("wan@480x832x81" if real else "wan@16x16x5", "wan",
                  catalog.REAL_CONFIGS["wan"] if real else families.TINY_CONFIGS["wan"],
                  (480, 832) if real else (16, 16), 81 if real else 5, 1, (226, 4096, 0) if real else (16, 32, 0), wan_vae))
    out: dict[str, Any] = {"real_size": real, "lora_rank": 32, "dtype": str(dtype), "cases": {}}
    ok = True
    for name, family, kwargs, px, frames, rows, text, vae in cases:
        case = _memory_case(family, kwargs, px, frames, rows, text, vae, device, dtype)
        out["cases"][name] = case
        if device.type != "cuda":
            ok &= case["planned_saved_bytes"] == case["measured_saved_bytes"] and abs(case["plan_error"]) <= 0.1
        print(f"gpu_check:   memory {name} {case}", flush=True)
    out["ok"] = ok
    return out


def optimizer_offload(device: torch.device, real: bool) -> dict[str, Any]:
    """bench/offload.py: model.offload = "optimizer" against "none" on a bf16 full fine-tune of
    a random SD3 transformer (12 blocks 1536 wide on a GPU, ~0.35B parameters; a tiny one on
    a CPU): device bytes per parameter, pass and step seconds, and the weights after 5 steps
    each (CPU AdamW against CUDA AdamW: float32 rounding apart)."""
    import argparse

    spec = importlib.util.spec_from_file_location("digenrl_bench_offload", ROOT / "bench" / "offload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(layers=12 if real else 2, heads=96 if real else 4, dtype="bfloat16", repeats=5,
                              threads=torch.get_num_threads(), cpu=device.type == "cpu")
    out: dict[str, Any] = module.run(args)
    out["ok"] = out["device_bytes_ratio"] < 0.5 and out["weights_max_abs_diff"] < 1e-4
    print(f"gpu_check:   offload {out['device_bytes_per_param']} step ratio {out['step_s_ratio']:.2f}", flush=True)
    return out


def _transport_bench() -> Any:
    """bench/transport.py as a module (its staged-chunk measurement)."""
    spec = importlib.util.spec_from_file_location("digenrl_bench_transport", ROOT / "bench" / "transport.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _staged_round_trips(device: torch.device, numel: int, chunks: int) -> dict[str, Any]:
    """``chunks`` chunks staged off the device, sent and received over inproc PUSH/PULL and
    landed back on it; each landed pair compared bit for bit with its source (copies only:
    exactness is the point) when it lands and again once the next chunk has been staged
    through the pool (a buffer reused before its send completed would show then: on a CPU
    node the landed tensors are the sender's buffer, inproc being zero-copy), and the pools'
    reuse counted."""
    from digenrl.transport.options import SocketOptions, node_context
    from digenrl.transport.protocol import Chunk
    from digenrl.transport.sockets import Pull, Push
    from digenrl.transport.staging import DeviceToHost, HostToDevice

    d2h, h2d = DeviceToHost(device), HostToDevice(device)
    ctx = node_context()
    endpoint = f"inproc://gpu-check-staging-{time.monotonic_ns()}"
    options = SocketOptions(max_frame_bytes=max(64 << 20, 8 * numel))
    exact = True
    held: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # the chunk before: landed, source
    try:
        with Pull(ctx, options=options, lane="bulk") as pull, Push(ctx, options=options, lane="bulk") as push:
            pull.bind(endpoint)
            push.connect(endpoint)
            for i in range(chunks):
                src = [torch.randn(1, numel, device=device), torch.randn(1, numel, device=device)]
                staged = d2h.stage(src)  # a new pair every time, as a sampler makes them
                await staged.wait_ready()
                tracker = await push.send(Chunk(
                    task_id=i, step=0, fragment=0, t_index=i, sigma=0.5, sigma_next=0.4, policy_version=0,
                    x_t=staged.tensors[0], x_next=staged.tensors[1], log_prob=torch.zeros(1)), track=True)
                staged.release(tracker)
                _, msg = await pull.recv()
                assert isinstance(msg, Chunk)
                landed = h2d.stage([msg.x_t, msg.x_next]).wait()
                del msg
                held.append((landed, src))
                exact &= all(a.device == b.device and torch.equal(a, b) for got, want in held
                             for a, b in zip(got, want))
                del held[:-1]  # the previous chunk's buffers may be reused from now on
    finally:
        ctx.term()
    pools = {"device_to_host": d2h.pool.statistics(),
             "host_to_device": h2d.pool.statistics() if h2d.pool is not None else None}
    return {"exact": exact, "chunks": chunks, "numel": numel, "pools": pools}


def staging(device: torch.device, real: bool) -> dict[str, Any]:
    import asyncio

    import uvloop

    from digenrl.transport.options import COPY_BELOW

    bench = _transport_bench()
    numel = (1 << 20) // 4 if real else COPY_BELOW // 4  # CPU: the smallest tensor sent zero-copy
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        trips = runner.run(_staged_round_trips(device, numel, 16 if real else 6))
    sizes = {"1m": (1 << 20, 200), "16m": (16 << 20, 30)} if real else {"256k": (COPY_BELOW, 20)}
    goodput = {key: bench.staged_chunk_goodput(str(device), nbytes, count, repeats=3 if real else 1)
               for key, (nbytes, count) in sizes.items()}
    reused = trips["pools"]["device_to_host"]["reused"]
    return {**trips, "goodput": goodput, "ok": trips["exact"] and reused > 0}


def _rollout_folder(folder: Path, real: bool) -> tuple[Path, int]:
    """The rollout section's pipeline folder and image size (module doc)."""
    from tests.pipelines import write_pipeline_folder

    if not real:
        return write_pipeline_folder("flux", folder, vae_factor=8), 64
    import shutil

    import diffusers

    from tests.pipelines import clip_encoder, clip_tokenizer, t5_encoder, t5_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe: Any = diffusers.FluxPipeline(
            transformer=diffusers.FluxTransformer2DModel(num_layers=2, num_single_layers=4, guidance_embeds=True),
            vae=diffusers.AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False),
            text_encoder=clip_encoder(False, hidden=768), tokenizer=clip_tokenizer(folder / "_clip"),
            text_encoder_2=t5_encoder(4096), tokenizer_2=t5_tokenizer(),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True))
    pipe.to(torch.bfloat16).save_pretrained(folder)
    shutil.rmtree(folder / "_clip", ignore_errors=True)
    return folder, 512


def rollout_engine(work: Path, device: torch.device, real: bool) -> dict[str, Any]:
    """The rollout section (module doc)."""
    import math

    spec = importlib.util.spec_from_file_location("digenrl_bench_rollout", ROOT / "bench" / "rollout.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    folder, size = _rollout_folder(work / "rollout-flux", real)
    res = bench.measure(folder, size, repeats=3 if real else 1, device=device, join=real,
                        dtype="bfloat16" if real else "float32")
    figures = [v for k, v in res.items() if isinstance(v, float)] + list(res["forward_ms_by_rows"].values())
    return {**res, "size": size, "ok": all(math.isfinite(v) and v > 0 for v in figures)}


def _run_report(proc: subprocess.CompletedProcess[str], run_dir: Path) -> dict[str, Any]:
    """What a launched run says about itself: exit code, summary.json's figures, each metrics
    row's ratio_max_dev, each node's device; ``ok`` when it ran to the end with nothing in flight."""
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    acc = summary.get("accounting", {})
    rows = _metrics(run_dir)
    return {"ok": proc.returncode == 0 and acc.get("in_flight") == 0 and summary.get("stop_reason") == "done",
            "returncode": proc.returncode, "wall_s": summary.get("wall_s"), "samples_per_s": summary.get("samples_per_s"),
            "startup_s": summary.get("startup_s"), "steps": len(rows), "accounting": acc,
            "ratio_max_dev": [r.get("ratio_max_dev") for r in rows],
            "recovery": summary.get("recovery"), "nodes": _node_devices(run_dir),
            "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}


def default_run(work: Path, steps: int | None) -> dict[str, Any]:
    run_dir = work / "default"
    report = _run_report(_launch(["--steps", str(steps)] if steps else [], run_dir, 600), run_dir)
    report["ok"] = report["ok"] and (steps is None or report["steps"] == steps)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="what runs without a GPU, at tiny sizes")
    ap.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    ap.add_argument("--skip", default="", metavar="SECTION,...",
                    help=f"sections not to run (recorded as skipped), of {', '.join(SECTIONS)}")
    ap.add_argument("--only", default="", metavar="SECTION,...",
                    help="run these sections alone (the others recorded as skipped)")
    args = ap.parse_args(argv)
    skip = {x for x in args.skip.split(",") if x}
    only = {x for x in args.only.split(",") if x}
    for flag, named in (("--skip", skip), ("--only", only)):
        if named - set(SECTIONS):
            ap.error(f"{flag} {','.join(sorted(named))}: unknown section(s) {sorted(named - set(SECTIONS))}; "
                     f"expected {list(SECTIONS)}")
    if skip and only:
        ap.error("--skip and --only: give one of them")
    if only:
        skip = set(SECTIONS) - only
    from digenrl.devices import resolve_device

    device = torch.device("cpu") if args.cpu else resolve_device()
    out: dict[str, Any] = {"command": " ".join(["bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": str(device),
                           "cpu_mode": args.cpu, "skipped": sorted(skip), "sections": {}}
    if not args.cpu and device.type != "cuda":
        out["sections"]["build"] = {**build_info(device), "ok": False,
                                    "error": "no CUDA device visible (use --cpu for the CPU subset)"}
    else:
        with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
            work = Path(tmp)
            sections: dict[str, Callable[[], dict[str, Any]]] = {
                "build": lambda: build_info(device),
                "nvml": nvml_reading,
                "k0_bf16": lambda: k0_bf16(work, 2 if args.cpu else 3),
                "transformers": lambda: transformer_steps(device, real=not args.cpu),
                "memory": lambda: memory_peaks(device, real=not args.cpu),
                "offload": lambda: optimizer_offload(device, real=not args.cpu),
                "staging": lambda: staging(device, real=not args.cpu),
                "rollout": lambda: rollout_engine(work, device, real=not args.cpu),
                "default_run": lambda: default_run(work, 1 if args.cpu else None)}
            for name, fn in sections.items():
                if name not in skip and not (name == "nvml" and args.cpu):
                    _section(out, name, fn, Path(args.out))
    _write(out, Path(args.out))
    print(f"gpu_check: ok={out['ok']} -> {args.out}", flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
