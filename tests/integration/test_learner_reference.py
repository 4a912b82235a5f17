"""The learner against an independent plain GRPO loop (tests/integration/plain_grpo.py)
on the same trajectories: the same steps are taken and skipped, and the weights agree
to float rounding after every step."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.support.synthetic import fixed_groups
from services.trainer.config import TrainerConfig
from tests.integration.plain_grpo import PlainGrpo, relative_distance

pytestmark = pytest.mark.engine

# Groups 4 and 6 come from version 0 and are trained at version >= 3 (dropped with lag
# bound 2); every 5th group has equal rewards. Two groups per step.
VERSIONS = [0, 0, 0, 1, 0, 2, 0, 3, 3, 3]
SETTINGS = {"lr": 1e-3, "max_policy_lag": 2, "tis_cap": 2.0, "groups_per_step": 2, "threads": 1}
# Rounding differences (padding, summation order) stay far below this; a wrong loss
# moves the weights in another direction, at a distance of the order of the step.
TOLERANCE = 1e-3


def test_learner_matches_an_independent_plain_loop(tiny_model: Path) -> None:
    from services.trainer.learner import Learner

    groups = fixed_groups(tiny_model, len(VERSIONS), group_size=3, versions=VERSIONS, flat_every=5)
    learner = Learner(tiny_model, TrainerConfig(model=str(tiny_model), **SETTINGS))  # type: ignore[arg-type]
    plain = PlainGrpo(tiny_model, lr=SETTINGS["lr"], max_policy_lag=SETTINGS["max_policy_lag"], tis_cap=SETTINGS["tis_cap"])
    start = plain.parameters()
    for i in range(0, len(groups), 2):
        batch = groups[i : i + 2]
        assert learner.step(batch).stepped == plain.step(batch), f"batch {i // 2}: one stepped, the other did not"
        assert learner.version == plain.version
        ours = {name: p.detach() for name, p in learner.module.named_parameters()}
        if plain.version:
            distance = relative_distance(ours, plain.parameters(), start)
            assert distance < TOLERANCE, f"after batch {i // 2} the learner is {distance:.2e} (relative) away from the plain loop"
    assert plain.version >= 3, "the fixture should take several real steps"
