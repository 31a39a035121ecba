"""Wan2.2 T2V-A14B's two experts (models/video.py WanExperts) on a tiny folder WanPipeline saved:
routing at boundary_ratio as the pipeline does, LoRA and full weights on both or one expert,
what is synced and saved, final/ in diffusers, the expert metric, and the bad folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from digenrl.config import ConfigError, ModelConfig, load_config, resolve_mode
from digenrl.launch import launch, make_run_dir
from digenrl.models import build_model
from digenrl.telemetry.metrics import documented_keys, is_documented, read_metrics
from tests.conftest import SUITE_SETS
from tests.pipelines import MAX_TEXT_TOKENS, SMALL, load_pipeline, write_pipeline_folder

BOUNDARY = 0.875  # tests/pipelines.py _wan22, as the released A14B folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pipeline_folder("wan22", tmp_path_factory.mktemp("wan22") / "pipe")


def _model(folder: Path, **kw) -> object:
    return build_model(ModelConfig(family="wan", path=str(folder), max_text_tokens=MAX_TEXT_TOKENS, **SMALL, **kw))


def test_each_row_goes_to_the_expert_the_pipeline_would_use(folder: Path) -> None:
    model = _model(folder)
    pipe = load_pipeline(folder)
    cond = model.encode_prompts(["a red fox", "a blue bird", "a tree"])
    x = torch.randn(3, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.95, BOUNDARY, 0.4])  # high, exactly the boundary (high, as t >= boundary), low
    v = model.velocity(x, sigmas, cond)
    for i, expert in enumerate((pipe.transformer, pipe.transformer, pipe.transformer_2)):
        want = expert(hidden_states=x[i:i + 1], timestep=sigmas[i:i + 1] * 1000,
                      encoder_hidden_states=cond["prompt_embeds"][i:i + 1], return_dict=False)[0]
        # two module instances (ours and the pipeline's): a tolerance, not bits
        torch.testing.assert_close(v[i:i + 1], want.float(), rtol=1e-4, atol=1e-5)
    assert [model.expert_of(s) for s in (0.95, BOUNDARY, 0.4)] == ["transformer", "transformer", "transformer_2"]


def test_lora_lands_on_both_experts_or_only_the_trained_one(folder: Path) -> None:
    both = _model(folder, lora_rank=4)
    keys = set(both.sync_state_dict())
    assert {k.split(".")[0] for k in keys} == {"transformer", "transformer_2"}
    assert all("lora_" in k for k in keys)
    high = _model(folder, lora_rank=4, train_experts="high")
    assert {k.split(".")[0] for k in high.sync_state_dict()} == {"transformer"}  # the low expert is never sent
    assert not any("lora_" in n for n, _ in high.transformer.transformer_2.named_parameters())
    full_low = _model(folder, train_experts="low")
    trainable = {n.split(".")[0] for n, p in full_low.transformer.named_parameters() if p.requires_grad}
    assert trainable == {"transformer_2"}
    assert {k.split(".")[0] for k in full_low.sync_state_dict()} == {"transformer_2"}


def _run(tmp: Path, folder: Path, *extra: str, mode: str = "colocated", steps: int = 2) -> Path:
    cfg = resolve_mode(load_config(None, [
        *SUITE_SETS, f'model.path="{folder}"', 'model.family="wan"', f"model.max_text_tokens={MAX_TEXT_TOKENS}",
        *[f"model.{k}={v}" for k, v in SMALL.items()], "train.prompts_per_step=2", "train.group_size=2",
        "runtime.fragments_per_step=1", "sampler.num_steps=4", 'train.timesteps="all"', f"run.steps={steps}",
        *extra]), mode)
    run_dir = make_run_dir(cfg, str(tmp))
    launch(cfg, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def lora_run(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("lora") / "run", folder, "model.lora_rank=4")


def test_a_lora_run_trains_both_experts_and_names_each_timesteps_expert(lora_run: Path, folder: Path) -> None:
    from safetensors.torch import load_file

    rows = read_metrics(lora_run)
    assert len(rows) == 2
    # K = 0 in one process: the trainer recomputes the rollout's own samples, bit for bit
    assert all(r["ratio_max_dev"] == 0.0 for r in rows)
    # every trained timestep's expert is where boundary_ratio puts its sigma
    from digenrl.rl.sde import sigma_schedule
    sampler = load_config(lora_run / "config.toml").sampler
    sig = sigma_schedule(sampler.num_steps, sampler.shift)
    for r in rows:
        experts = {int(k.split("/t")[1]): v for k, v in r.items() if k.startswith("expert/t")}
        assert experts == {t: 0 if float(sig[t]) * 1000 >= BOUNDARY * 1000 else 1 for t in range(4)}
        assert set(experts.values()) == {0, 1}  # this schedule crosses the boundary
        assert r["expert/changed"] == 3  # so every step's update changed both experts
        assert all(is_documented(k, documented_keys()) for k in r)
    trained = load_file(lora_run / "final" / "policy.safetensors")
    base = _model(folder, lora_rank=4).sync_state_dict()
    for expert in ("transformer.", "transformer_2."):  # both moved off their initial LoRA
        assert any(not torch.equal(v, base[k]) for k, v in trained.items() if k.startswith(expert))


def test_final_loads_into_wan_pipeline_expert_by_expert_and_changes_its_output(lora_run: Path, folder: Path) -> None:
    final = lora_run / "final"
    assert (final / "pytorch_lora_weights.safetensors").is_file()
    assert (final / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    pipe = load_pipeline(folder)
    x = torch.randn(1, 4, 3, 16, 24, generator=torch.Generator().manual_seed(1))
    text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))

    def outputs() -> list[torch.Tensor]:
        return [m(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                  return_dict=False)[0] for m in (pipe.transformer, pipe.transformer_2)]

    before = outputs()
    pipe.load_lora_weights(final)
    pipe.load_lora_weights(final / "transformer_2", load_into_transformer_2=True)
    after = outputs()
    assert all(not torch.allclose(a, b) for a, b in zip(before, after, strict=True))


def test_a_full_run_of_the_low_expert_saves_it_apart_and_leaves_the_high_one(folder: Path, tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    with pytest.raises(ConfigError, match=r"indices \[0, 1\], which the other expert denoises.*2..3"):
        _run(tmp_path / "refused", folder, "model.train_experts=\"low\"", steps=1)  # 'all' steps
    with pytest.raises(ConfigError, match=r"train.algorithm = 'nft': its noise levels span both experts"):
        _run(tmp_path / "nft", folder, "model.train_experts=\"low\"", 'train.algorithm="nft"', steps=1)
    run_dir = _run(tmp_path / "run", folder, "model.train_experts=\"low\"", 'train.timesteps="window"',
                   "train.window_lo=2", "train.window_size=2", "train.window_hi=4", steps=1)
    final = run_dir / "final"
    assert (final / "transformer_2" / "config.json").is_file()
    assert not (final / "config.json").exists()  # the high expert was not trained: not saved
    low = WanTransformer3DModel.from_pretrained(final / "transformer_2")
    base_low = WanTransformer3DModel.from_pretrained(folder / "transformer_2")
    assert any(not torch.equal(a, b) for a, b in zip(low.state_dict().values(), base_low.state_dict().values()))


def test_train_experts_on_a_one_expert_folder_is_a_config_error(tmp_path: Path) -> None:
    one = write_pipeline_folder("wan", tmp_path / "wan21")
    with pytest.raises(ConfigError, match=r"model.train_experts = 'high'.*one transformer"):
        _model(one, train_experts="high")


def test_experts_of_different_shapes_are_refused_naming_the_tensor(folder: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "transformer_2" / "config.json").read_text())
    cfg["ffn_dim"] = 48
    (bad / "transformer_2" / "config.json").write_text(json.dumps(cfg))
    from diffusers import WanTransformer3DModel
    WanTransformer3DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")}).save_pretrained(bad / "transformer_2")
    with pytest.raises(ConfigError, match=r"transformer/ and transformer_2/ disagree in shape.*ffn"):
        _model(bad)


def test_a_merged_export_holds_both_trained_experts_and_loads_without_peft(lora_run: Path, tmp_path: Path) -> None:
    from diffusers import WanPipeline

    from digenrl.export import export_run

    out = tmp_path / "export"
    export_run(lora_run, out, merge=True, ema=False)
    pipe = WanPipeline.from_pretrained(out, local_files_only=True)
    ours = build_model(ModelConfig(family="wan", path=str(load_config(lora_run / "config.toml").model.path),
                                   lora_rank=4, max_text_tokens=MAX_TEXT_TOKENS, **SMALL))
    from safetensors.torch import load_file
    ours.load_sync_state_dict(load_file(lora_run / "final" / "policy.safetensors"))
    cond = ours.encode_prompts(["a red fox"])
    x = torch.randn(1, *ours.latent_shape, generator=torch.Generator().manual_seed(3))
    for sigma, expert in ((0.95, pipe.transformer), (0.4, pipe.transformer_2)):
        want = expert(hidden_states=x, timestep=torch.tensor([sigma * 1000]),
                      encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
        # merged weights (W + s B A) against the adapter's separate product: float rounding apart
        torch.testing.assert_close(ours.velocity(x, sigma, cond), want.float(), rtol=1e-4, atol=1e-5)


def test_an_unmerged_export_loads_each_experts_lora_into_wan_pipeline(lora_run: Path, tmp_path: Path) -> None:
    """``digenrl export`` without --merge: the base pipeline with one LoRA file per expert,
    loaded as diffusers loads Wan2.2 LoRAs, computes what the adapter computes."""
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from digenrl.export import export_run

    out = tmp_path / "export"
    assert export_run(lora_run, out, merge=False, ema=False)["merged"] is False
    assert (out / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    pipe = WanPipeline.from_pretrained(out, local_files_only=True)
    ours = build_model(ModelConfig(family="wan", path=str(load_config(lora_run / "config.toml").model.path),
                                   lora_rank=4, max_text_tokens=MAX_TEXT_TOKENS, **SMALL))
    ours.load_sync_state_dict(load_file(lora_run / "final" / "policy.safetensors"))
    cond = ours.encode_prompts(["a red fox"])
    x = torch.randn(1, *ours.latent_shape, generator=torch.Generator().manual_seed(4))

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            return [(ours.velocity(x, sigma, cond),
                     expert(hidden_states=x, timestep=torch.tensor([sigma * 1000]),
                            encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0].float())
                    for sigma, expert in ((0.95, pipe.transformer), (0.4, pipe.transformer_2))]

    assert all(not torch.allclose(got, want, rtol=1e-4, atol=1e-5) for got, want in pairs())  # base alone
    pipe.load_lora_weights(out)
    pipe.load_lora_weights(out / "transformer_2", load_into_transformer_2=True)
    for got, want in pairs():
        # the same LoRA weights in two module instances: a tolerance, not bits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unsharded", "fsdp"])
def test_two_tsp_trainer_ranks_each_hold_and_train_only_their_expert(folder: Path, tmp_path: Path, fsdp: bool) -> None:
    """digenrl mode, real processes, K = 0: with TSP rank 0 trains step indices 0, 1 and rank 1
    indices 2, 3, so rank 0 loads only transformer and rank 1 only transformer_2
    (rl/experts.py). Each rank says so in its log and in the step's all-reduce (``expert/held/r<i>``,
    from the modules it loaded); the experts the trained indices used are where the folder's
    boundary_ratio puts their sigmas; rank 0 gathers transformer_2 from rank 1 for final/.
    With ``model.fsdp = true`` each expert is sharded over its one holder, and the checkpoint
    is DCP shards of both ranks."""
    from safetensors.torch import load_file

    from digenrl.rl.sde import sigma_schedule
    from digenrl.telemetry.logging import node_log_path

    # runtime.tag as by default (bts): a rank holding one expert offers no trainer-assisted generation
    run_dir = _run(tmp_path / "run", folder, "model.lora_rank=4", "cluster.trainers=2", "runtime.staleness=0",
                   f"model.fsdp={str(fsdp).lower()}", mode="digenrl")
    from digenrl.rl.checkpoint import latest_checkpoint
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.version == 2 and ckpt.trainer["layout"] == ("dcp" if fsdp else "whole")
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["admitted"] == acc["trained"] + sum(acc["discarded"].values()) and acc["in_flight"] == 0
    assert acc["trained"] == 2 * 4 and not acc["discarded"]  # 2 steps x 4 trajectories
    rows = read_metrics(run_dir)
    assert len(rows) == 2
    cfg = load_config(run_dir / "config.toml")
    ratio = json.loads((folder / "model_index.json").read_text())["boundary_ratio"]
    sig = sigma_schedule(cfg.sampler.num_steps, cfg.sampler.shift)
    want = {f"expert/t{t}": 0 if float(sig[t]) * 1000 >= ratio * 1000 else 1 for t in range(4)}
    assert set(want.values()) == {0, 1}  # the schedule crosses the boundary
    for r in rows:
        assert {k: v for k, v in r.items() if k.startswith("expert/t")} == want
        assert (r["expert/held/r0"], r["expert/held/r1"]) == (1, 2)  # 1: transformer, 2: transformer_2
        assert all(is_documented(k, documented_keys()) for k in r)
    # K = 0: the first ratio of each step is the rollout's own sample recomputed by a trainer
    # rank in another process, from the same weights: 1 within 1e-6 (float32 on one CPU)
    assert all(r["ratio_max_dev"] <= 1e-6 for r in rows)
    held = sorted((e["rank"], e["experts"], list(e["trained"])) for n in ("trainer-0", "trainer-1")
                  for line in node_log_path(run_dir, n).read_text().splitlines() if '"experts held"' in line
                  for e in [json.loads(line)])  # ranks go by the order the nodes joined
    assert held == [(0, ["transformer"], ["transformer"]), (1, ["transformer_2"], ["transformer_2"])]
    final = run_dir / "final"
    assert (final / "pytorch_lora_weights.safetensors").is_file()
    assert (final / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    trained = load_file(final / "policy.safetensors")
    base = _model(folder, lora_rank=4).sync_state_dict()
    assert trained.keys() == base.keys()
    for expert in ("transformer.", "transformer_2."):  # both moved off their initial LoRA
        assert any(not torch.equal(v, base[k]) for k, v in trained.items() if k.startswith(expert))


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pipeline_folder("wan22-ti2v", tmp_path_factory.mktemp("ti2v") / "pipe")


def test_a_ti2v_velocity_is_the_pipelines_transformer_call_on_per_token_timesteps(ti2v: Path) -> None:
    """The timestep as WanPipeline builds it with expand_timesteps (pipeline_wan.py: a ones
    mask of the latent's shape, ``(mask[0][0][:, ::2, ::2] * t).flatten()`` expanded over the
    batch) against the adapter's velocity, row by row at two sigmas."""
    model = _model(ti2v)
    pipe = load_pipeline(ti2v)
    cond = model.encode_prompts(["a red fox", "a blue bird"])
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    sigmas = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        v = model.velocity(x, sigmas, cond)
        mask = torch.ones(x.shape)
        for i in range(2):
            t = sigmas[i] * 1000
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(1, -1)
            want = pipe.transformer(hidden_states=x[i:i + 1], timestep=timestep,
                                    encoder_hidden_states=cond["prompt_embeds"][i:i + 1], return_dict=False)[0]
            # two module instances (ours and the pipeline's): a tolerance, not bits
            torch.testing.assert_close(v[i:i + 1], want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["a14b", "ti2v"])
def test_a_wan22_folder_generates_what_wan_pipeline_generates(layout: str, folder: Path, ti2v: Path) -> None:
    """Our steps against WanPipeline's own call on the same prompts and noise: A14B's switch of
    experts mid-trajectory (3 steps at shift 5 cross 0.875), TI2V's per-token timesteps and its
    48-channel VAE."""
    import itertools

    from tests.test_model_folders import PROMPTS, diffusers_call

    path = folder if layout == "a14b" else ti2v
    model = _model(path)
    if layout == "ti2v":
        assert model.expand_timesteps and model.latent_shape == (48, 3, 8, 12)  # 4x spatial, 2x temporal
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    pipe = load_pipeline(path)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = diffusers_call("wan", pipe, x0)
        sigmas = pipe.scheduler.sigmas.tolist()
        if layout == "a14b":
            assert sigmas[0] >= BOUNDARY > sigmas[2]  # the trajectory uses both experts
        cond = model.encode_prompts(PROMPTS)
        x = x0
        for s, s_next in itertools.pairwise(sigmas):
            x = x + (s_next - s) * model.velocity(x, s, cond)
        images = model.decode(x)
    assert images.shape == expected.shape
    # one uint8 level: the two uint8 roundings differ only at a .5 boundary
    assert (images.int() - expected.int()).abs().max() <= 1


def _ti2v_transformer_output(transformer: torch.nn.Module) -> torch.Tensor:
    """One call of a TI2V transformer as WanPipeline makes it: a per-token timestep (B, tokens)."""
    x = torch.randn(1, 48, 3, 8, 12, generator=torch.Generator().manual_seed(1))
    tokens = 3 * (8 // 2) * (12 // 2)  # frames x (H / patch) x (W / patch), patch 1x2x2
    text = torch.randn(1, MAX_TEXT_TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=torch.full((1, tokens), 500.0), encoder_hidden_states=text,
                           return_dict=False)[0]


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_a_ti2v_folder_trains_at_k0_with_a_first_ratio_of_one_and_final_loads(
        lora_rank: int, ti2v: Path, tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    run_dir = _run(tmp_path / "run", ti2v, f"model.lora_rank={lora_rank}")
    rows = read_metrics(run_dir)
    assert len(rows) == 2 and all(r["ratio_max_dev"] == 0.0 for r in rows)  # same instance recomputes
    assert not any(k.startswith("expert/") for r in rows for k in r)  # one expert
    final = run_dir / "final"
    pipe = load_pipeline(ti2v)
    before = _ti2v_transformer_output(pipe.transformer)
    if lora_rank:
        pipe.load_lora_weights(final)
        after = _ti2v_transformer_output(pipe.transformer)
    else:
        assert not (final / "pytorch_lora_weights.safetensors").exists()
        after = _ti2v_transformer_output(WanTransformer3DModel.from_pretrained(final))
    assert after.shape == before.shape
    assert not torch.allclose(after, before)  # the trained weights change the pipeline's transformer output


def test_the_planner_prices_a14b_as_two_experts_and_ti2v_as_the_5b(folder: Path, ti2v: Path, tmp_path: Path) -> None:
    from digenrl.core.costmodel import MODELS
    from digenrl.models.meta import cost_model_name

    def name(path: Path) -> str:
        return cost_model_name(ModelConfig(family="wan", path=str(path)))

    assert name(folder) == "wan22_a14b" and name(ti2v) == "wan22_ti2v_5b"
    assert name(write_pipeline_folder("wan", tmp_path / "wan21")) == "wan"
    a14b, wan21 = MODELS["wan22_a14b"], MODELS["wan"]
    # one expert runs per step: Wan2.1-14B's forward, twice its weights
    assert a14b.fwd_tflop == wan21.fwd_tflop and a14b.params_b == 2 * wan21.params_b
    assert MODELS["wan22_ti2v_5b"].latent_shape[0] == 48
