"""``digenrl export``: a run's trained policy as a standalone diffusers pipeline folder.

The run directory is made as a run leaves it: its ``config.toml`` (``to_toml``) and ``final/``
written by the trainer's own ``save_final`` from a policy whose trained weights were moved
(standing in for training). The exported folder is then loaded by plain diffusers and
compared with the base pipeline plus the run's LoRA, on a tiny SD3 pipeline folder of the real
classes.
"""

from __future__ import annotations

import json

import pytest
import torch

from digenrl.config import load_config, to_toml
from tests.pipelines import MAX_TEXT_TOKENS, write_pipeline_folder

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """(base pipeline folder, run dir) of a LoRA run of version 3 whose adapter was moved."""
    from digenrl.models import build_model
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import Policy

    root = tmp_path_factory.mktemp("export")
    base = write_pipeline_folder("sd3", root / "base")
    cfg = load_config(None, [f'model.path="{base}"', 'model.family="sd3"', "model.lora_rank=2",
                             f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.height=32", "model.width=48",
                             "sampler.num_steps=3", "sampler.base_tail=0", 'train.timesteps="all"'])
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(cfg))
    policy = Policy(build_model(cfg.model, seed=cfg.run.seed), cfg.train, cfg.sampler)
    with torch.no_grad():
        for i, p in enumerate(policy.params):  # every trained weight moves
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    policy.version = 3
    save_final(policy, run_dir)
    rows = [{"step": 3, "policy_version": 3, "eval/reward": 0.625}, {"step": 2, "policy_version": 3, "loss": 0.1}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, run_dir


def _generate(pipe) -> torch.Tensor:
    """The pipeline's own call, fixed seed, latents out (no VAE rounding in the comparison)."""
    with torch.no_grad():
        return pipe(prompt=PROMPTS, num_inference_steps=3, height=32, width=48, guidance_scale=1.0,
                    max_sequence_length=MAX_TEXT_TOKENS, output_type="latent",
                    generator=torch.Generator().manual_seed(7)).images


def test_a_merged_export_loads_without_peft_and_generates_what_the_trained_policy_generates(trained_run, tmp_path):
    import diffusers

    from digenrl.export import export_run

    base, run_dir = trained_run
    out = tmp_path / "exported"
    result = export_run(run_dir, out, merge=True)
    assert result == {"kind": "pipeline", "version": 3, "merged": True, "out": str(out),
                      "from": str(run_dir / "final" / "policy.safetensors")}
    exported = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    # plain diffusers: no adapter in the loaded transformer, the LoRA is in its weights
    assert not any("lora_" in name for name, _ in exported.transformer.named_parameters())
    assert not getattr(exported.transformer, "_hf_peft_config_loaded", False)
    assert not (out / "pytorch_lora_weights.safetensors").exists()

    reference = diffusers.DiffusionPipeline.from_pretrained(base, local_files_only=True)
    untrained = _generate(reference)
    reference.load_lora_weights(run_dir / "final")  # the trained policy as diffusers runs it
    trained = _generate(reference)
    assert not torch.allclose(trained, untrained, atol=1e-3)  # the adapter matters
    # merging W + s B A is a different float32 summation order than applying B A beside W:
    # equal to rounding, not bit for bit
    torch.testing.assert_close(_generate(exported), trained, atol=1e-4, rtol=1e-4)

    card = (out / "README.md").read_text()
    assert f"`{base}`" in card and "policy version 3" in card and "LoRA merged" in card
    assert "| `eval/reward` | 0.625 |" in card and "shapes_judge (weight 1)" in card and "```toml" in card


def test_an_unmerged_export_keeps_the_base_transformer_and_the_lora_beside_it(trained_run, tmp_path):
    import diffusers

    from digenrl.export import export_run

    base, run_dir = trained_run
    out = tmp_path / "unmerged"
    assert export_run(run_dir, out)["merged"] is False
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    base_weights = base / "transformer" / "diffusion_pytorch_model.safetensors"
    assert (out / "transformer" / base_weights.name).read_bytes() == base_weights.read_bytes()
    pipe = diffusers.DiffusionPipeline.from_pretrained(out, local_files_only=True)
    pipe.load_lora_weights(out)
    reference = diffusers.DiffusionPipeline.from_pretrained(base, local_files_only=True)
    reference.load_lora_weights(run_dir / "final")
    # the same files loaded the same way in one process: exactly equal
    assert torch.equal(_generate(pipe), _generate(reference))


def test_export_errors_name_the_path_and_what_to_do(trained_run, tmp_path):
    from digenrl.export import ExportError, export_run

    base, run_dir = trained_run
    with pytest.raises(ExportError, match=r"no config\.toml"):
        export_run(tmp_path, tmp_path / "o1")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ExportError, match="not an empty folder"):
        export_run(run_dir, busy)

    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.toml").write_text((run_dir / "config.toml").read_text())
    with pytest.raises(ExportError, match=r"neither final/policy\.safetensors nor"):
        export_run(unfinished, tmp_path / "o2")

    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.toml").write_text((run_dir / "config.toml").read_text().replace(str(base), str(tmp_path / "gone")))
    with pytest.raises(ExportError, match=r"base model .*gone.* does not exist"):
        export_run(moved, tmp_path / "o3")
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o3.tmp").exists()


def test_a_run_of_the_shipped_tiny_model_exports_its_transformer_folder(tmp_path):
    """The builtin base has no VAE or text encoders: the export is the merged transformer, which
    the transformer class loads and which predicts the trained velocity."""
    from digenrl.export import export_run
    from digenrl.models import build_model
    from digenrl.models.families import SPECS
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import Policy

    cfg = load_config(None, ["model.lora_rank=2"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    model = build_model(cfg.model, seed=cfg.run.seed)
    policy = Policy(model, cfg.train, cfg.sampler)
    with torch.no_grad():
        for i, p in enumerate(policy.params):
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    save_final(policy, tmp_path)
    out = tmp_path / "exported"
    assert export_run(tmp_path, out, merge=True)["kind"] == "transformer"
    transformer = SPECS["sd3"].cls.from_pretrained(out, local_files_only=True)
    assert not any("lora_" in name for name, _ in transformer.named_parameters())
    loaded = SPECS["sd3"].adapter(transformer, encoder=model.encoder, decoder=model.decoder,
                                  latent_shape=model.latent_shape)
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_export, v_trained = loaded.velocity(x, 0.6, cond), model.velocity(x, 0.6, cond)
        with model.adapter_disabled():
            v_base = model.velocity(x, 0.6, cond)
    assert (v_trained - v_base).abs().max() > 0.05  # the adapter moves the velocity ...
    # ... and the merged weights reproduce it to float32 rounding of the folded sum (the
    # builtin transformer is deeper than the pipeline's, so the rounding adds up to ~2e-4)
    torch.testing.assert_close(v_export, v_trained, atol=1e-3, rtol=1e-3)


def test_a_run_stopped_before_final_exports_its_newest_checkpoint(tmp_path):
    from digenrl.export import export_run
    from digenrl.models import build_model
    from digenrl.rl.checkpoint import commit_checkpoint, save_trainer_state
    from digenrl.rl.policy import Policy

    cfg = load_config(None, ["model.lora_rank=2"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    policy = Policy(build_model(cfg.model, seed=cfg.run.seed), cfg.train, cfg.sampler)
    policy.version = 5
    save_trainer_state(tmp_path, policy, {})
    commit_checkpoint(tmp_path, 5, {})
    result = export_run(tmp_path, tmp_path / "exported", merge=True)
    assert result["version"] == 5 and result["from"].endswith("policy.safetensors")
    assert "checkpoint" in result["from"] and (tmp_path / "exported" / "config.json").is_file()


def test_export_ema_writes_the_ema_weights_and_refuses_a_run_without_them(tmp_path):
    """``--ema`` exports final/ema/: the merged transformer predicts what the policy predicts
    with its EMA weights, not with its trained ones; a run with no EMA gets a one-line error."""
    from digenrl.export import ExportError, export_run
    from digenrl.models import build_model
    from digenrl.models.families import SPECS
    from digenrl.rl.ema import ema_weights, live_weights
    from digenrl.rl.learner import save_final
    from digenrl.rl.policy import Policy

    cfg = load_config(None, ["model.lora_rank=2", "train.ema_decay=0.5"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    model = build_model(cfg.model, seed=cfg.run.seed)
    policy = Policy(model, cfg.train, cfg.sampler)
    with torch.no_grad():
        for i, p in enumerate(policy.params):
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    policy.ema.update(live_weights(policy))  # halfway between the initial and the moved weights
    policy.version = 1
    save_final(policy, tmp_path)
    rows = [{"step": 1, "policy_version": 1, "eval/r": 0.5, "eval_ema/r": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "exported"
    result = export_run(tmp_path, out, merge=True, ema=True)
    assert result["from"].endswith("final/ema/policy.safetensors") and result["version"] == 1
    card = (out / "README.md").read_text()
    assert "EMA of the weights (decay 0.5)" in card and "`eval_ema/r` | 0.25" in card
    transformer = SPECS["sd3"].cls.from_pretrained(out, local_files_only=True)
    loaded = SPECS["sd3"].adapter(transformer, encoder=model.encoder, decoder=model.decoder,
                                  latent_shape=model.latent_shape)
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_export, v_trained = loaded.velocity(x, 0.6, cond), model.velocity(x, 0.6, cond)
        with ema_weights(policy):
            v_ema = model.velocity(x, 0.6, cond)
    assert (v_trained - v_ema).abs().max() > 0.02  # the EMA is not the trained policy ...
    torch.testing.assert_close(v_export, v_ema, atol=1e-3, rtol=1e-3)  # ... and is what was exported

    plain = tmp_path / "plain"
    plain.mkdir()
    plain_cfg = load_config(None, ["model.lora_rank=2"])
    (plain / "config.toml").write_text(to_toml(plain_cfg))
    save_final(Policy(build_model(plain_cfg.model, seed=0), plain_cfg.train, plain_cfg.sampler), plain)
    with pytest.raises(ExportError, match=r"no final/ema/policy.safetensors \(the run kept no EMA"):
        export_run(plain, tmp_path / "o4", ema=True)


def test_a_damaged_policy_file_is_one_error_naming_it(trained_run, tmp_path):
    from digenrl.export import ExportError, export_run

    _, run_dir = trained_run
    torn = tmp_path / "torn"
    (torn / "final").mkdir(parents=True)
    (torn / "config.toml").write_text((run_dir / "config.toml").read_text())
    data = (run_dir / "final" / "policy.safetensors").read_bytes()
    (torn / "final" / "policy.safetensors").write_bytes(data[: len(data) // 3])  # a crash mid-write
    with pytest.raises(ExportError, match=r"policy\.safetensors is not a readable safetensors file"):
        export_run(torn, tmp_path / "out")
