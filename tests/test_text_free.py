"""model.free_text_encoders: a node encodes the run's prompts once, keeps the rows in a host
table and drops its text encoder modules (digenrl/models/text.py).

Tiny real pipeline folders of two families (SD3: CLIP-L, CLIP-G and T5; FLUX: CLIP-L and T5),
the rollout's own fragment path (FragmentJob) before and after the encoders leave.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from digenrl.config import ConfigError, load_config
from tests.pipelines import MAX_TEXT_TOKENS, write_pipeline_folder

TRAIN = ["a red circle", "a blue square on grass", "three green triangles", "a small yellow cross"]
TEST = ["a purple diamond", "a red circle"]  # a prompt in both sets is encoded once
FAMILIES = ("sd3", "flux")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text-free")
    (root / "train.txt").write_text("\n".join(TRAIN) + "\n")
    (root / "test.txt").write_text("\n".join(TEST) + "\n")
    return {"root": root, **{f: write_pipeline_folder(f, root / f) for f in FAMILIES}}


def _cfg(folders: dict[str, Path], family: str, *sets: str):
    root = folders["root"]
    return load_config(None, [f'model.path="{folders[family]}"', f'model.family="{family}"',
                              f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.height=32", "model.width=32",
                              "sampler.num_steps=3", 'train.timesteps="all"', "train.group_size=2",
                              f'prompts.file="{root / "train.txt"}"', f'prompts.test_file="{root / "test.txt"}"',
                              "model.free_text_encoders=true", *sets])


def _fragment(model, cfg, prompts: list[str]):
    from digenrl.rl.fragment import FragmentJob

    job = FragmentJob(model=model, cfg=cfg, prompts=prompts, seeds=list(range(7, 7 + 2 * len(prompts))),
                      sde_steps=[0, 1, 2], trained_steps=[0, 1, 2], reward_fn=None)
    with torch.no_grad():
        records, result = job.run_all()
    return records, result


@pytest.mark.parametrize("family", FAMILIES)
def test_freed_text_encoders_leave_samples_and_log_probs_unchanged_and_are_gone(
        folders: dict[str, Path], family: str) -> None:
    from digenrl.models import build_model
    from digenrl.models.text import free_text_encoders

    cfg = _cfg(folders, family)
    model = build_model(cfg.model, seed=0)
    pipe = model.encoder.pipe
    encoders = {name: part for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)}
    assert {"text_encoder", "text_encoder_2"} <= set(encoders)
    refs = {name: weakref.ref(part) for name, part in encoders.items()}
    alone = {p: model.encode_prompts([p]) for p in (*TRAIN[:2], "")}
    fragment = TRAIN[:2]
    before_records, before = _fragment(model, cfg, fragment)
    del encoders

    stats = free_text_encoders(model, cfg)
    assert stats is not None and stats["prompts"] == len(set(TRAIN + TEST)) + 1  # and ""
    assert stats["parameters"] > 0 and stats["bytes"] > 0
    # the launcher's estimate (before any process starts) is a lower bound of the real table:
    # the token embeddings alone, all of them
    from digenrl.models.footprint import text_table_bytes
    embeds = sum(model.encode_prompts([p])["prompt_embeds"].numel() * 4 for p in model.encoder.table)
    assert text_table_bytes(cfg, stats["prompts"]) == embeds < stats["bytes"]
    gc.collect()
    # the modules are gone: no attribute holds them and nothing else keeps them alive
    assert all(getattr(pipe, name) is None for name in refs)
    assert all(ref() is None for ref in refs.values()), [n for n, r in refs.items() if r() is not None]
    # each prompt's row is the prompt encoded alone, bit for bit (same process, same inputs,
    # same batch of one)
    for p, cond in alone.items():
        row = model.encode_prompts([p])
        assert row.keys() == cond.keys() and all(torch.equal(row[k], cond[k]) for k in cond)

    after_records, after = _fragment(model, cfg, fragment)
    # Before freeing, the fragment's prompts were encoded as one batch; the table holds each
    # encoded alone. Where the encoders' kernels round the same whatever the batch (FLUX's
    # tiny CLIP and T5 here) the samples are bit for bit the same; SD3's differ from the batch
    # by float32 rounding (measured: conditioning within 1.2e-7, final latents within 4.8e-7,
    # log-probs within 1.2e-7 over 3 steps), hence the tolerance of 1e-5.
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(after.final, before.final, **tol)
    assert before_records.keys() == after_records.keys()
    for t in before_records:
        torch.testing.assert_close(after_records[t].log_prob, before_records[t].log_prob, **tol)
        torch.testing.assert_close(after_records[t].x_next, before_records[t].x_next, **tol)
    if family == "flux":
        assert torch.equal(after.final, before.final)

    with pytest.raises(ValueError, match=r"prompt 'a prompt from nowhere' is not among the 6 prompts"):
        model.encode_prompts(["a prompt from nowhere"])


def test_a_table_past_its_budget_stops_naming_the_size_and_keeps_the_encoders(folders: dict[str, Path]) -> None:
    from digenrl.models import build_model
    from digenrl.models.text import free_text_encoders

    cfg = _cfg(folders, "flux")
    model = build_model(cfg.model, seed=0)
    pipe = model.encoder.pipe
    row = sum(v.numel() * v.element_size() for v in model.encode_prompts(["a"]).values())
    with pytest.raises(ConfigError, match=r"^model.free_text_encoders = true: the conditioning of the run's "
                                          r"6 prompts takes about [0-9.]+ MiB of host memory, above "
                                          r"model.text_cache_mb = [0-9.e-]+; [^\n]*$"):
        model.encoder.free([*TRAIN, *TEST, ""], 2 * row)  # room for two rows
    assert pipe.text_encoder is not None and pipe.text_encoder_2 is not None and model.encoder.table is None
    assert model.encode_prompts(["not in any prompt file"])["prompt_embeds"].shape[0] == 1  # still encodes
    off = _cfg(folders, "flux", "model.free_text_encoders=false")
    assert free_text_encoders(model, off) is None and pipe.text_encoder is not None


def test_a_launched_run_frees_the_encoders_on_every_node_and_trains_the_same_weights(
        folders: dict[str, Path]) -> None:
    """``digenrl launch`` (disagg-sync: a rollout node and a trainer node) on the FLUX folder,
    with and without model.free_text_encoders: each node logs what it freed, and the final
    weights are the same bit for bit (exact: this folder's encoders give a prompt the same row
    alone as in a batch, and a disagg-sync run replays the same arithmetic; tests/test_resume.py
    relies on the same)."""
    import json

    from tests.conftest import SMALL, final_weights, launch_run

    root = folders["root"]
    sets = [*SMALL, f'model.path="{folders["flux"]}"', 'model.family="flux"', "model.lora_rank=2",
            f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.height=32", "model.width=32",
            f'prompts.file="{root / "train.txt"}"', f'prompts.test_file="{root / "test.txt"}"', "run.steps=2"]
    runs = {}
    for free in (True, False):
        run_dir = root / f"run-{free}"
        r = launch_run("--mode", "disagg-sync", "--run-dir", str(run_dir),
                       sets=[*sets, f"model.free_text_encoders={str(free).lower()}"])
        assert r.returncode == 0, r.stderr[-3000:]
        runs[free] = run_dir
    for node in ("rollout-0", "trainer-0"):
        rows = [json.loads(line) for line in (runs[True] / "logs" / f"{node}.log").read_text().splitlines()
                if "text_encoders_freed" in line]
        assert len(rows) == 1 and rows[0]["prompts"] == len(set(TRAIN + TEST)) + 1 and rows[0]["parameters"] > 0
        assert "text_encoders_freed" not in (runs[False] / "logs" / f"{node}.log").read_text()
    a, b = final_weights(runs[True]), final_weights(runs[False])
    assert a.keys() == b.keys() and a
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # trained (B starts at 0)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_table_that_cannot_fit_is_refused_by_the_launcher_before_any_process_starts(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """400 prompts of FLUX's fixed 24 x 32 float32 token rows need at least 1.17 MiB: above a
    1 MiB budget, refused in one line before a node starts."""
    from digenrl.config import resolve_mode
    from digenrl.launch import launch, make_run_dir
    from tests.conftest import SMALL

    prompts = tmp_path / "many.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(400)))
    cfg = resolve_mode(load_config(None, [*SMALL, f'model.path="{folders["flux"]}"', 'model.family="flux"',
                                          f"model.max_text_tokens={MAX_TEXT_TOKENS}", "model.height=32",
                                          "model.width=32", f'prompts.file="{prompts}"',
                                          "model.free_text_encoders=true", "model.text_cache_mb=1"]), "digenrl")
    run_dir = make_run_dir(cfg, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^model.free_text_encoders = true: the conditioning of the run's 401 "
                                          r"prompts takes at least 1.17 MiB of host memory, above "
                                          r"model.text_cache_mb = 1; [^\n]*$"):
        launch(cfg, run_dir)
    assert not list((run_dir / "logs").glob("*.stderr"))  # no child was ever started


def test_an_edit_family_whose_text_encoder_reads_the_images_is_refused_at_config_load() -> None:
    with pytest.raises(ConfigError, match=r"^model.free_text_encoders = true with model.family = "
                                          r"'qwenimage_edit': [^\n]*$"):
        load_config(None, ['model.family="qwenimage_edit"', 'model.path="random"', "model.free_text_encoders=true"])
