"""Worker groups over NCCL: the tiny model on two GPUs of one host, one rank each.

Runs where MLX has CUDA and NCCL and sees two GPUs; skipped with its reason elsewhere. It uses no
conftest helper, so that a GPU host without the HTTP clients can run it alone
(``pytest -q --noconftest tests/test_group_nccl.py``). Keep NCCL_NVLS_ENABLE=0 set where the host
asks for it: the ranks inherit this process's environment.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from mlxrt import ModelLoadError, Runtime

PROMPTS = [
    ("Once upon a time", 20),
    ("The harbour was quiet that night and the boats " * 6, 12),
    ([5, 17, 42, 99, 3, 250], 16),
]


def _why_not() -> str | None:
    """None where this host can run the group, else why not."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return "MLX has no CUDA here"
    if not mx.distributed.is_available("nccl"):
        return "this MLX build has no NCCL backend"
    gpus = mx.device_count(mx.gpu)
    return None if gpus >= 2 else f"MLX sees {gpus} GPU(s); the group needs 2"


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def tiny() -> str:
    """The `tiny` synthetic model (float32: tensor parallelism's sums round as one process's do)."""
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("tiny"))


def _ids(rt) -> list[list[int]]:
    alone = [rt.generate(p, max_tokens=n, ignore_eos=True).tokens for p, n in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda x: rt.generate(x[0], max_tokens=x[1], ignore_eos=True).tokens,
                                 PROMPTS))
    return alone + together


def test_two_gpus_over_nccl_give_one_rank_s_greedy_ids(tiny):
    """A tensor-parallel group over NCCL, each rank on its own GPU, gives one process's greedy ids,
    alone and batched (it failed once in the first all_sum, both ranks' arrays on one GPU, and once
    in mlx-lm's CPU-stream barrier after loading)."""
    with Runtime(model=tiny) as one:
        want = _ids(one)
    with Runtime(model=tiny, ranks=2, backend="nccl", sharding="tensor") as rt:
        (w,) = rt.workers
        assert [r.state for r in w.ranks] == ["ready", "ready"]
        assert _ids(rt) == want


def test_pipeline_over_nccl_is_refused_with_why(tiny):
    """MLX's NCCL backend has no send/recv, which mlx-lm's pipeline needs: the start fails saying so."""
    with pytest.raises(ModelLoadError, match="send/recv"):
        Runtime(model=tiny, ranks=2, backend="nccl", sharding="pipeline")
