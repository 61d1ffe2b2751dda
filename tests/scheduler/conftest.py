"""Every scheduler test that builds its config with `small_config` runs under both checkpoint modes ("scan": saves
listed in the plan and written by the step; "promote": the original design's chunk-per-step promotion), except the
ones marked `promote_only`, which spell out the original design's step-by-step shapes, and `own_mode`, which set
the mode themselves. (The property test draws the
mode itself.)"""
import pytest

from tests.scheduler import sched_helpers


def pytest_generate_tests(metafunc):
    if "checkpoint_mode" in metafunc.fixturenames and not metafunc.definition.get_closest_marker("own_mode"):
        modes = ["promote"] if metafunc.definition.get_closest_marker("promote_only") else ["scan", "promote"]
        metafunc.parametrize("checkpoint_mode", modes, indirect=True)


@pytest.fixture(autouse=True)
def checkpoint_mode(request):
    sched_helpers.DEFAULT_MODE = getattr(request, "param", "promote")
    yield sched_helpers.DEFAULT_MODE
    sched_helpers.DEFAULT_MODE = "promote"
