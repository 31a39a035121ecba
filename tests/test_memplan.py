"""digenrl/models/memplan.py: saved-activation bytes counted on the meta device against the
same forward measured on the CPU (real tensors, real tiny transformers)."""

from __future__ import annotations

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

from digenrl.models import families
from digenrl.models.memplan import training_forward_saved_bytes


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_the_meta_count_equals_the_bytes_a_cpu_training_forward_saves(family: str) -> None:
    """Exact: the meta forward runs the same ops on the same shapes as the CPU forward with
    math attention (the path the meta device takes), so the saved bytes are equal."""
    kw = dict(family=family, transformer_kwargs=families.TINY_CONFIGS[family], px=64, batch=2,
              text=(16, 32, 32), lora_rank=4)
    planned = training_forward_saved_bytes(**kw, device="meta")  # type: ignore[arg-type]
    with sdpa_kernel(SDPBackend.MATH):
        measured = training_forward_saved_bytes(**kw, device="cpu")  # type: ignore[arg-type]
    assert planned == measured > 0


def test_the_count_is_linear_in_batch_and_grows_with_resolution() -> None:
    """Each sample adds the same bytes (per-sample activations); a few saved tensors do not
    depend on the batch (rotary / position tables), so the check is on differences."""
    kw = dict(family="flux", transformer_kwargs=families.TINY_CONFIGS["flux"], text=(16, 32, 32), lora_rank=4)
    b1, b2, b3 = (training_forward_saved_bytes(**kw, px=32, batch=b) for b in (1, 2, 3))  # type: ignore[arg-type]
    assert b3 - b2 == b2 - b1 > 0
    assert training_forward_saved_bytes(**kw, px=64, batch=1) > 2 * b1  # type: ignore[arg-type]
