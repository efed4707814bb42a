"""How work is cut: blocks of slices on threads (segnode.node.pipeline.parallel), patches per GPU
forward pass."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from segnode.engines.manifest_parse import load_manifest
from segnode.engines.models import default_manifest_path
from segnode.engines.torch_backend import GPU_BATCH_VOXELS, default_batch
from segnode.node.pipeline import parallel
from segnode.node.pipeline.parallel import blocks, map_blocks


@pytest.mark.parametrize(
    ("count", "step", "parts"), [(128, 2, 16), (7, 2, 4), (1, 8, 4), (100, 1, 3), (64, 64, 8)]
)
def test_blocks_cover_the_range_once(count: int, step: int, parts: int) -> None:
    ranges = blocks(count, step, parts)
    covered = [i for a, b in ranges for i in range(a, b)]
    assert covered == list(range(count))
    assert all((b - a) % step == 0 for a, b in ranges[:-1])
    assert len(ranges) <= parts


def test_map_blocks_returns_results_in_order_and_uses_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEGNODE_ENCODE_THREADS", "4")
    names: set[str] = set()

    def block(a: int, b: int) -> list[int]:
        names.add(threading.current_thread().name)
        time.sleep(0.01)
        return list(range(a, b))

    out = map_blocks(block, 40, 2)
    assert [i for part in out for i in part] == list(range(40))
    assert len(out) > 1 and any(n.startswith("segnode-encode") for n in names)


def test_map_blocks_raises_the_first_failing_block_after_all_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SEGNODE_ENCODE_THREADS", "4")
    finished: list[int] = []

    def block(a: int, b: int) -> int:
        if a >= 10:
            time.sleep(0.02 if a == 10 else 0.0)
            raise ValueError(f"block {a}")
        time.sleep(0.05)
        finished.append(a)
        return a

    with pytest.raises(ValueError, match="block 10$"):
        map_blocks(block, 40, 5)
    assert sorted(finished) == [0, 5]  # the slow good blocks ran to their end


def test_one_thread_runs_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEGNODE_ENCODE_THREADS", "1")
    assert parallel.threads() == 1
    caller = threading.current_thread().name
    ran = map_blocks(lambda a, b: threading.current_thread().name, 10, 1)
    assert ran and set(ran) == {caller}


def test_gpu_batch_fills_the_voxel_budget_within_the_manifest() -> None:
    tissue = load_manifest(default_manifest_path())  # 2 x 512 x 512 patches, batch 1..32
    assert default_batch(tissue, on_gpu=False) == tissue.batch_opt == 1
    assert default_batch(tissue, on_gpu=True) == 32 == GPU_BATCH_VOXELS // (2 * 512 * 512)
    unet = replace(tissue, patch_size=(128, 128, 128), batch_opt=2, batch_max=4)
    assert default_batch(unet, on_gpu=True) == 4  # 8 would fit the budget, the engine says 4
    big = replace(tissue, patch_size=(320, 320, 320), batch_opt=2, batch_max=8)
    assert default_batch(big, on_gpu=True) == 2  # one patch exceeds the budget: batch.opt
    assert np.prod(big.patch_size) > GPU_BATCH_VOXELS
