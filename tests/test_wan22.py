"""Wan2.2 under the ``wan`` family: TI2V-5B's layout (48-channel residual VAE, per-token
timesteps) and T2V-A14B's (two experts, ``transformer`` above ``boundary_ratio`` and
``transformer_2`` below), on tiny random-weight folders saved by ``WanPipeline``.

Our model and the diffusers pipeline are different module instances, so their outputs are
compared with the suite's tolerance (tests/conftest.py); weights read back bit for bit.
"""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from digenrl.config import ModelConfig
from digenrl.models import ModelFolderError, build_model
from tests.conftest import assert_close_across_instances, assert_same_weights
from tests.pipelines import MAX_TEXT_TOKENS, SMALL, load_pipeline, write_pipeline_folder

PROMPTS = ["a red circle", "a blue square on the left"]
CASES = ("wan22-ti2v", "wan22-a14b")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan22")
    return {c: write_pipeline_folder(c, root / c) for c in CASES}


def model_cfg(path, **kw) -> ModelConfig:
    return ModelConfig(family="wan", path=str(path), max_text_tokens=MAX_TEXT_TOKENS, **{**SMALL, **kw})


def test_the_folders_have_wan22s_pipeline_config(folders):
    ti2v = json.loads((folders["wan22-ti2v"] / "model_index.json").read_text())
    a14b = json.loads((folders["wan22-a14b"] / "model_index.json").read_text())
    assert ti2v["expand_timesteps"] is True and ti2v.get("boundary_ratio") is None
    assert a14b["boundary_ratio"] == 0.875 and a14b["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    model = build_model(model_cfg(folders["wan22-ti2v"]))
    # 48 latent channels; 4x in space (2x2 patchify, one downsampling), 2x in time
    assert model.latent_shape == (48, 3, 8, 12) and model.expand_timesteps and model.transformer_2 is None


@pytest.mark.parametrize("case", CASES)
def test_a_wan22_folder_generates_what_wanpipeline_generates(case, folders):
    """The adapter's Euler steps from the pipeline's sigmas and the VAE decode give WanPipeline's
    own frames: per-token timesteps (TI2V) and the expert switch at the boundary (A14B)."""
    model = build_model(model_cfg(folders[case]))
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    pipe = load_pipeline(folders[case])
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(prompt=list(PROMPTS), num_inference_steps=3, output_type="pt", max_sequence_length=MAX_TEXT_TOKENS,
                   guidance_scale=1.0, latents=x0, **SMALL).frames
        b, f, c, h, w = out.shape
        expected = (out.permute(0, 2, 3, 1, 4).reshape(b, c, h, f * w) * 255).round().to(torch.uint8)
        cond = model.encode_prompts(PROMPTS)
        x = x0
        sigmas = pipe.scheduler.sigmas.tolist()
        for s, s_next in itertools.pairwise(sigmas):
            x = x + (s_next - s) * model.velocity(x, s, cond)
        images = model.decode(x)
    if case == "wan22-a14b":  # the three steps cross the boundary: both experts ran
        assert [model.expert_of(s) for s in sigmas[:-1]] == ["high", "low", "low"], sigmas
    assert images.shape == expected.shape
    assert (images.int() - expected.int()).abs().max() <= 1  # rounding at a .5 boundary, one level at most


def test_ti2v_velocity_is_the_pipelines_transformer_call_with_per_token_timesteps(folders):
    model = build_model(model_cfg(folders["wan22-ti2v"]))
    pipe = load_pipeline(folders["wan22-ti2v"])
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS)
    t = torch.tensor(0.6) * 1000
    # pipeline_wan.py's expand_timesteps branch, verbatim in effect
    mask = torch.ones(x.shape, dtype=torch.float32)
    timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(x.shape[0], -1)
    assert timestep.shape == (2, 3 * 4 * 6)
    with torch.no_grad():
        theirs = pipe.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
                                  return_dict=False)[0]
        ours = model.velocity(x, 0.6, cond)
    assert_close_across_instances(ours, theirs)


def test_the_expert_boundary_is_where_boundary_ratio_puts_it(folders):
    """``transformer`` for sigma * 1000 >= boundary_ratio * 1000 (the boundary itself included),
    ``transformer_2`` below; a batch straddling the boundary gives each sample its own expert."""
    model = build_model(model_cfg(folders["wan22-a14b"]))
    assert model.boundary_ratio == 0.875 and model.num_train_timesteps == 1000
    assert [model.expert_of(s) for s in (1.0, 0.876, 0.875, 0.874, 0.1)] == ["high", "high", "high", "low", "low"]
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    cond = model.encode_prompts(PROMPTS)

    def direct(expert, sigma):
        return expert(hidden_states=x, timestep=torch.full((2,), sigma * 1000), encoder_hidden_states=cond["prompt_embeds"],
                      return_dict=False)[0]

    with torch.no_grad():
        # same module, same inputs, same process: exact
        assert torch.equal(model.velocity(x, 0.875, cond), direct(model.transformer, 0.875))
        assert torch.equal(model.velocity(x, 0.874, cond), direct(model.transformer_2, 0.874))
        assert not torch.allclose(direct(model.transformer, 0.874), direct(model.transformer_2, 0.874))
        mixed = model.velocity(x, torch.tensor([0.9, 0.5]), cond)
        assert_close_across_instances(mixed[0], direct(model.transformer, 0.9)[0])
        assert_close_across_instances(mixed[1], direct(model.transformer_2, 0.5)[1])


def test_train_experts_on_a_one_expert_folder_and_mismatched_experts_are_one_line(folders, tmp_path):
    from digenrl.models import check_model_path
    from digenrl.models.registry import ExpertMismatchError

    with pytest.raises(ModelFolderError, match=r"^model\.train_experts = 'high': .* has one transformer") as e:
        check_model_path(model_cfg(folders["wan22-ti2v"], train_experts="high"))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelFolderError, match=r"model\.train_experts = 'low'"):
        check_model_path(ModelConfig(family="wan", path="random", train_experts="low"))
    check_model_path(model_cfg(folders["wan22-a14b"], train_experts="low"))
    bad = write_pipeline_folder("wan22-a14b", tmp_path / "bad", mismatch=True)
    with pytest.raises(ExpertMismatchError, match=r"transformer/ and transformer_2/ differ in shape .* e\.g\. ") as e:
        build_model(model_cfg(bad))
    assert "\n" not in str(e.value)
    noratio = shutil.copytree(folders["wan22-a14b"], tmp_path / "noratio")
    index = json.loads((noratio / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (noratio / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="lists transformer_2 but no boundary_ratio"):
        build_model(model_cfg(noratio))


def _one_step(model, tmp_path, *, num_steps: int = 3):
    """One GRPO step on the model's own rollout (K = 0: the first ratio is 1 within 1e-6), then
    final/; returns the step's stats and final/."""
    from digenrl.config import load_config
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import Policy
    from digenrl.rl.sampler import rollout, seeded_generators

    # a large learning rate: one AdamW step moves every trained weight by about lr
    cfg = load_config(None, [f"sampler.num_steps={num_steps}", "sampler.shift=5.0", "train.timesteps=\"all\"",
                             "train.lr=0.05"])
    policy = Policy(model, cfg.train, cfg.sampler)
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        records = dict(enumerate(rollout(model, cond, generator=seeded_generators([5, 6]), sampler_cfg=cfg.sampler)))
    stats = policy.fragment_loss_backward(records, cond, torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.bool),
                                          batch_size_total=2, n_trained_total=len(records))
    assert stats["ratio_max_dev"] <= 1e-6, stats
    policy.optimizer_step()
    save_final(policy, tmp_path)
    return stats, records, tmp_path / "final"


def _loaded_velocity(pipe, model, x, cond):
    from digenrl.models.video import WanModel

    loaded = WanModel(pipe.transformer, encoder=model.encoder, decoder=model.decoder, latent_shape=model.latent_shape,
                      transformer_2=getattr(pipe, "transformer_2", None))
    loaded.expand_timesteps, loaded.boundary_ratio = model.expand_timesteps, model.boundary_ratio
    return torch.cat([loaded.velocity(x, s, cond) for s in (0.95, 0.5)])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("case", CASES)
def test_a_trained_step_saves_a_final_that_loads_into_wanpipeline(case, lora, folders, tmp_path):
    """LoRA: one file per expert, the second loaded with ``load_into_transformer_2=True``; full:
    ``transformer/`` and ``transformer_2/`` (A14B) or the transformer folder (TI2V). The loaded
    pipeline's velocity is the trained model's, on both sides of the boundary."""
    import diffusers

    from digenrl.models.adapter import LORA_FILE, LORA_FILE_2

    model = build_model(model_cfg(folders[case], lora_rank=2 if lora else 0))
    x = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        v_base = torch.cat([model.velocity(x, s, cond) for s in (0.95, 0.5)])
    stats, records, final = _one_step(model, tmp_path)
    two = case == "wan22-a14b"
    if two:
        experts = [model.expert_of(r.sigma) for r in records.values()]
        assert stats["expert/high"] == experts.count("high") >= 1 and stats["expert/low"] == experts.count("low") >= 1
    else:
        assert not any(k.startswith("expert/") for k in stats)
    pipe = load_pipeline(folders[case])
    with torch.no_grad():
        if lora:
            pipe.load_lora_weights(final, weight_name=LORA_FILE)
            if two:
                pipe.load_lora_weights(final, weight_name=LORA_FILE_2, load_into_transformer_2=True)
            files = ["policy.safetensors", LORA_FILE, *([LORA_FILE_2] if two else [])]
            assert sorted(p.name for p in final.iterdir()) == sorted(files)
        elif two:
            pipe.transformer = diffusers.WanTransformer3DModel.from_pretrained(final / "transformer")
            pipe.transformer_2 = diffusers.WanTransformer3DModel.from_pretrained(final / "transformer_2")
        else:
            pipe.transformer = diffusers.WanTransformer3DModel.from_pretrained(final, local_files_only=True)
        v_trained = torch.cat([model.velocity(x, s, cond) for s in (0.95, 0.5)])
        v_loaded = _loaded_velocity(pipe, model, x, cond)
    assert not torch.allclose(v_trained[:1], v_base[:1], atol=1e-3)  # the training is in the file
    if two:
        assert not torch.allclose(v_trained[1:], v_base[1:], atol=1e-3)  # both experts trained
    assert_close_across_instances(v_loaded, v_trained)
    if lora and two:
        sd = model.sync_state_dict()
        loaded = {k.replace(".default_0", ""): v for k, v in pipe.transformer_2.state_dict().items() if "lora_" in k}
        assert_same_weights(loaded, {k.removeprefix("transformer_2."): v for k, v in sd.items()
                                     if k.startswith("transformer_2.")})


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_train_experts_high_trains_sends_and_saves_the_high_expert_only(lora, folders, tmp_path):
    from digenrl.models.adapter import LORA_FILE

    model = build_model(model_cfg(folders["wan22-a14b"], lora_rank=2 if lora else 0, train_experts="high"))
    low_before = {k: v.clone() for k, v in model.transformer_2.state_dict().items()}
    sd = model.sync_state_dict()
    assert sd and not any(k.startswith("transformer_2.") for k in sd)  # the sync never carries it
    stats, records, final = _one_step(model, tmp_path)
    n_high = sum(model.expert_of(r.sigma) == "high" for r in records.values())
    assert stats["expert/high"] == n_high >= 1 and "expert/low" not in stats and stats["n"] == 2 * n_high
    assert_same_weights(model.transformer_2.state_dict(), low_before)
    names = sorted(p.name for p in final.iterdir())
    assert names == (sorted(["policy.safetensors", LORA_FILE]) if lora else ["policy.safetensors", "transformer"])


@pytest.mark.parametrize("merge", [False, True], ids=["lora", "merged"])
def test_export_of_a_two_expert_lora_run_loads_into_wanpipeline_with_both_experts_trained(merge, folders, tmp_path):
    """``digenrl export``: unmerged, both experts' LoRA files beside the base pipeline; merged,
    ``transformer/`` and ``transformer_2/`` replaced. Either way the pipeline generates what the
    trained policy's experts give, and not what the base gives."""
    import diffusers
    from safetensors.torch import load_file

    from digenrl.config import load_config, to_toml
    from digenrl.export import export_run
    from digenrl.models.adapter import LORA_FILE, LORA_FILE_2
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import Policy

    base = folders["wan22-a14b"]
    cfg = load_config(None, [f'model.path="{base}"', 'model.family="wan"', "model.lora_rank=2",
                             f"model.max_text_tokens={MAX_TEXT_TOKENS}", *[f"model.{k}={v}" for k, v in SMALL.items()],
                             "sampler.num_steps=3", "sampler.base_tail=0", 'train.timesteps="all"'])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(cfg))
    policy = Policy(build_model(cfg.model, seed=cfg.run.seed), cfg.train, cfg.sampler)
    with torch.no_grad():
        for i, p in enumerate(policy.params):  # every trained weight of both experts moves
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    save_final(policy, run_dir)
    out = tmp_path / "out"
    export_run(run_dir, out, merge=merge)
    if merge:
        assert not (out / LORA_FILE).exists()
        pipe = diffusers.WanPipeline.from_pretrained(out, local_files_only=True)
    else:
        assert (out / LORA_FILE).is_file() and (out / LORA_FILE_2).is_file()
        pipe = load_pipeline(out)
        pipe.load_lora_weights(out, weight_name=LORA_FILE)
        pipe.load_lora_weights(out, weight_name=LORA_FILE_2, load_into_transformer_2=True)
    trained = build_model(cfg.model, seed=cfg.run.seed)
    trained.load_sync_state_dict(load_file(str(run_dir / "final" / "policy.safetensors")))
    base_model = build_model(cfg.model, seed=cfg.run.seed)
    x = torch.randn(1, *trained.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = trained.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        v_trained = torch.cat([trained.velocity(x, s, cond) for s in (0.95, 0.5)])
        v_export = _loaded_velocity(pipe, trained, x, cond)
        with base_model.adapter_disabled():
            v_base = torch.cat([base_model.velocity(x, s, cond) for s in (0.95, 0.5)])
    assert_close_across_instances(v_export, v_trained)
    assert not torch.allclose(v_export[:1], v_base[:1], atol=1e-3)
    assert not torch.allclose(v_export[1:], v_base[1:], atol=1e-3)


def test_the_planner_prices_wan22_folders_at_their_published_sizes(folders):
    """A14B: two 14 B experts, one active per step (a forward costs Wan2.1-14B's); TI2V-5B: 5 B
    on the 48-channel, 16x VAE's latent."""
    from digenrl.config import load_config
    from digenrl.core import costmodel as cm
    from digenrl.sim.simulator import workload_from_config

    def entry(case, *sets):
        cfg = load_config(None, ['model.family="wan"', f'model.path="{folders[case]}"', *sets])
        return workload_from_config(cfg).model

    assert entry("wan22-a14b") == "wan22_a14b" and entry("wan22-a14b", 'model.train_experts="low"') == "wan22_a14b_expert"
    assert entry("wan22-ti2v") == "wan22_ti2v_5b"
    assert cm.MODELS["wan22_a14b"].params_b == 27.0 and cm.MODELS["wan22_a14b_expert"].params_b == 14.0
    assert cm.MODELS["wan22_a14b"].fwd_tflop == cm.MODELS["wan"].fwd_tflop  # one expert runs per step
    ti2v = cm.MODELS["wan22_ti2v_5b"]
    assert ti2v.params_b == 5.0 and ti2v.latent_shape == (48, 31, 44, 80) and ti2v.latent_bytes == 2 * 48 * 31 * 44 * 80
    assert cm.sync_bytes("wan22_a14b_expert", 0) < cm.sync_bytes("wan22_a14b", 0)  # a frozen expert is never sent


@pytest.fixture(scope="module")
def colocated_runs(folders, tmp_path_factory):
    """Two-step colocated runs (in process): A14B with LoRA on both experts, TI2V full weights."""
    from digenrl.actors.colocated import run_colocated
    from digenrl.config import load_config, resolve_mode
    from tests.conftest import SMALL as SMALL_RUN

    runs = {}
    for case, sets in (("wan22-a14b", ["model.lora_rank=2"]), ("wan22-ti2v", ["model.lora_rank=0"])):
        run_dir = tmp_path_factory.mktemp(case)
        cfg = resolve_mode(load_config(None, [
            *SMALL_RUN, f'model.path="{folders[case]}"', 'model.family="wan"', *sets, "run.steps=2",
            f"model.max_text_tokens={MAX_TEXT_TOKENS}", *[f"model.{k}={v}" for k, v in SMALL.items()],
            "sampler.shift=5.0", 'train.timesteps="all"', "tracking.images_every=0"]), "colocated")
        run_colocated(cfg, run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[case] = (run_dir, [r for r in rows if "loss" in r], cfg)
    return runs


def test_a_colocated_two_expert_run_trains_both_experts_and_names_each_steps_expert(colocated_runs):
    from digenrl.rl.sde import sigma_schedule

    run_dir, rows, cfg = colocated_runs["wan22-a14b"]
    assert [r["step"] for r in rows] == [0, 1]
    sigmas = sigma_schedule(cfg.sampler.num_steps, cfg.sampler.shift)[:-1].tolist()
    n_high = sum(s >= 0.875 for s in sigmas)  # boundary_ratio 0.875 of 1000 train timesteps
    assert 0 < n_high < len(sigmas)
    fragments = cfg.runtime.fragments_per_step
    for r in rows:
        assert r["expert/high"] == n_high * fragments and r["expert/low"] == (len(sigmas) - n_high) * fragments, r
        assert r["ratio_max_dev"] <= 1e-6  # K = 0: the first ratio is 1
    from safetensors.torch import load_file
    sd = load_file(str(run_dir / "final" / "policy.safetensors"))
    assert any(k.startswith("transformer_2.") for k in sd) and any(not k.startswith("transformer_2.") for k in sd)


def test_a_colocated_ti2v_full_weight_run_trains(colocated_runs):
    run_dir, rows, _ = colocated_runs["wan22-ti2v"]
    assert [r["step"] for r in rows] == [0, 1] and all(r["ratio_max_dev"] <= 1e-6 for r in rows)
    assert all(not any(k.startswith("expert/") for k in r) for r in rows)
    assert (run_dir / "final" / "diffusion_pytorch_model.safetensors").is_file()


def test_one_trained_expert_with_a_forward_process_loss_is_a_config_error():
    from digenrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^model\.train_experts = 'high' with train\.algorithm = 'nft': "):
        load_config(None, ['model.train_experts="high"', 'train.algorithm="nft"'])


def test_a_two_expert_lora_run_launches_with_tsp_over_two_trainer_ranks(folders, tmp_path):
    """``digenrl launch`` (real processes: coordinator, rollout, two TSP trainer ranks): weight
    sync carries both experts' LoRA to the rollout, both experts train, final/ loads into
    WanPipeline."""
    from safetensors.torch import load_file

    from digenrl.config import load_config, resolve_mode
    from digenrl.launch import launch, make_run_dir
    from digenrl.models.adapter import LORA_FILE, LORA_FILE_2
    from digenrl.telemetry.metrics import read_metrics
    from tests.conftest import SMALL as SMALL_RUN

    cfg = resolve_mode(load_config(None, [
        *SMALL_RUN, f'model.path="{folders["wan22-a14b"]}"', 'model.family="wan"', "model.lora_rank=2",
        "run.steps=2", f"model.max_text_tokens={MAX_TEXT_TOKENS}", *[f"model.{k}={v}" for k, v in SMALL.items()],
        "sampler.shift=5.0", 'train.timesteps="all"', "tracking.images_every=0", "cluster.trainers=2",
        "runtime.fragments_per_step=1"]), "digenrl")
    assert cfg.runtime.tsp
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    summary = launch(cfg, run_dir)
    assert summary["steps"] == 2 and summary["recovery"]["rollouts_lost"] == 0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r.get("expert/high", 0) + r.get("expert/low", 0) > 0 for r in rows)  # rank 0's share
    sd = load_file(str(run_dir / "final" / "policy.safetensors"))
    assert any(k.startswith("transformer_2.") for k in sd) and any(not k.startswith("transformer_2.") for k in sd)
    pipe = load_pipeline(folders["wan22-a14b"])
    pipe.load_lora_weights(run_dir / "final", weight_name=LORA_FILE)
    pipe.load_lora_weights(run_dir / "final", weight_name=LORA_FILE_2, load_into_transformer_2=True)
    loaded = {k.replace(".default_0", ""): v for k, v in pipe.transformer_2.state_dict().items() if "lora_" in k}
    assert_same_weights(loaded, {k.removeprefix("transformer_2."): v for k, v in sd.items()
                                 if k.startswith("transformer_2.")})
