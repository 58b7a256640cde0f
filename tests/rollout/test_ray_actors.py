"""Starting Ray actors (a local Ray instance this module starts): what a start that fails says."""

from __future__ import annotations

import pytest
import ray

from rollout.ray_actors import ActorStartError, wait_actors_started
from tests.conftest import one_ray_at_a_time


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with one_ray_at_a_time():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="treadle-tests")
        yield
        ray.shutdown()


CUDA_ERROR = (
    "CUDA error: no kernel image is available for execution on the device\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


@ray.remote
class _NoKernelImage:
    def __init__(self):
        raise RuntimeError(CUDA_ERROR)

    def pid(self) -> int:
        return 0


def test_a_constructor_error_of_several_lines_is_said_whole_in_one_line():
    """The start's error took the last line of the traceback Ray quotes for the constructor's
    error: of an error whose message runs over lines (a CUDA error, a pydantic validation
    error) only its last, 'Compile with `TORCH_USE_CUDA_DSA` to enable device-side
    assertions.', neither the error's type nor what failed."""
    with pytest.raises(ActorStartError) as raised:
        wait_actors_started("engine", {"gpu-0": _NoKernelImage.remote()}, {}, 60, "engine.load_timeout_s")
    assert str(raised.value) == (
        "engine actor 'gpu-0' could not start: RuntimeError: " + " ".join(CUDA_ERROR.split())
    )
