"""GPU tests: collected only where torch sees a CUDA device."""

import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


def designs_here():
    """Designs that can run on this GPU (sm_90a runs both the sm90 and the Ada design)."""
    from cutekern.arch import DESIGNS_FOR_ARCH, target_arch
    return DESIGNS_FOR_ARCH[target_arch()]


@pytest.fixture(params=["sm90", "ada"])
def design(request, monkeypatch):
    if request.param not in designs_here():
        pytest.skip(f"{request.param} design does not run on this GPU")
    monkeypatch.setenv("CUTEKERN_DESIGN", request.param)
    return request.param


@pytest.fixture
def warm_graph_pool():
    """Call it before measuring what a capture allocates: torch allocates a small block for its
    generator state on a capture when no graph holding that state is alive, so one dummy
    capture is made and kept alive until the test ends."""
    keep = []

    def warm():
        x = torch.zeros(8, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
        torch.cuda.synchronize()
        keep.append(g)

    yield warm
    keep.clear()
