"""Within-prompt diversity (rl/diversity.py): the metric, the judge's and a CLIP folder's
features, its place in an evaluation row, and the launch check of eval.diversity."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from digenrl.config import ConfigError, load_config
from digenrl.data.prompts import load_splits
from digenrl.data.shapes import make_batch
from digenrl.launch import check_before_start
from digenrl.models import build_model
from digenrl.rl.diversity import (
    clip_features,
    diversity_features,
    judge_features,
    within_prompt_diversity,
)
from digenrl.rl.evaluate import build_eval_reward, evaluate
from digenrl.rl.rewards import RewardError
from digenrl.telemetry.metrics import documented_keys, is_documented
from tests.test_evaluate import TINY


def _shapes(n: int, seed: int = 0) -> torch.Tensor:
    return make_batch(random.Random(seed), n)[0]


def test_identical_samples_have_no_diversity_and_distinct_ones_have_some():
    f = torch.randn(1, 8).repeat(4, 1)
    assert within_prompt_diversity(f, [0, 0, 0, 0]) == 0.0
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    assert within_prompt_diversity(g, [0, 0, 0, 0]) > 0.1


def test_diversity_is_the_mean_over_prompts_of_the_mean_pairwise_distance():
    # two prompts: orthogonal unit features (distance sqrt 2) and identical ones (0)
    f = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 2.0], [5.0, 5.0]])
    d = within_prompt_diversity(f, [0, 0, 1, 1])
    assert d == pytest.approx(2 ** 0.5 / 2, rel=1e-12)
    assert within_prompt_diversity(f[:3], [0, 0, 1]) == pytest.approx(2 ** 0.5, rel=1e-12)  # one sample: not counted
    assert torch.isnan(torch.tensor(within_prompt_diversity(f[:2], [0, 1])))


def test_diversity_does_not_depend_on_the_order_of_the_samples():
    f = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    prompts = [0, 1, 2] * 4
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    # the same sums in another order: equal to float64 rounding
    assert within_prompt_diversity(f[perm], [prompts[i] for i in perm]) == \
        pytest.approx(within_prompt_diversity(f, prompts), rel=1e-12)


def test_the_judges_features_see_where_and_how_large_the_shape_is():
    features = judge_features()
    one = _shapes(1).repeat(6, 1, 1, 1)
    assert within_prompt_diversity(features(one), [0] * 6) == 0.0
    varied = _shapes(6, seed=3)
    assert within_prompt_diversity(features(varied), [0] * 6) > 0.05
    # the same picture moved: the judge's pooled logits barely change, its map does
    img = _shapes(1, seed=5)[0]
    shifted = torch.roll(img, shifts=(6, 6), dims=(1, 2))
    f = features(torch.stack([img, shifted]))
    assert within_prompt_diversity(f, [0, 0]) > 0.05


def _tiny_clip_folder(folder: Path) -> Path:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=32, projection_dim=8, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8)
    CLIPVisionModelWithProjection(cfg).save_pretrained(folder)
    return folder


def test_a_local_clip_folder_gives_image_embeddings_for_the_diversity(tmp_path):
    folder = _tiny_clip_folder(tmp_path / "clip")
    features = clip_features(str(folder))
    emb = features(_shapes(4))
    assert emb.shape == (4, 8) and torch.isfinite(emb).all()
    assert within_prompt_diversity(emb, [0] * 4) > 0
    cfg = load_config(None, [*TINY, f'eval.diversity="{folder}"'])
    assert diversity_features(cfg) is features  # loaded once per process


def test_an_eval_diversity_that_is_not_a_clip_folder_is_refused_before_the_launch(tmp_path):
    for bad, said in ((tmp_path / "nothing", "readable config.json"),):
        cfg = load_config(None, [*TINY, "run.eval_every=1", f'eval.diversity="{bad}"'])
        with pytest.raises(ConfigError, match=f"eval.diversity = '{bad}'.*{said}"):
            check_before_start(cfg)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(RewardError, match="a BertModel folder"):
        clip_features(str(tmp_path / "bert"))


def test_an_evaluation_with_several_samples_a_prompt_reports_its_diversity(tmp_path):
    cfg = load_config(None, [*TINY, "run.eval_every=1", 'eval.diversity="judge"'])
    test = load_splits(cfg.prompts)[1]
    row = evaluate(build_model(cfg.model, seed=0), cfg, test, build_eval_reward(cfg), version=0)
    assert 0 < row["eval/diversity"] <= 2
    assert is_documented("eval/diversity", documented_keys())
    off = load_config(None, [*TINY, "run.eval_every=1", 'eval.diversity="off"'])
    assert diversity_features(off) is None
    one = load_config(None, [*TINY, "eval.samples_per_prompt=1", 'eval.diversity="judge"'])
    assert diversity_features(one) is None  # no pairs to compare
    default = load_config(None, [])  # the shipped default evaluates with the shapes judge
    assert default.eval.diversity == "auto" and diversity_features(default) is not None


def test_the_spread_term_pays_each_sample_for_differing_from_the_rest_of_its_prompts_group():
    from digenrl.config import RewardTerm
    from digenrl.rl.rewards import build_reward

    reward = build_reward([RewardTerm(name="shapes_spread", weight=1.0)])
    same = _shapes(1, seed=4)
    other = _shapes(1, seed=9)
    images = torch.cat([same, same, same, other, same])
    prompts = ["a red circle on a blue background"] * 4 + ["a blue square on a red background"]
    r, parts = reward(images, prompts)
    assert r.shape == (5,) and torch.equal(parts["shapes_spread"], r)
    assert r[3] > r[0] > 0  # the odd one out is the farthest from its group
    assert r[0] == r[1] == r[2]  # same pixels, same group: the same arithmetic
    assert r[4] == 0  # alone with its prompt
