"""What the batched extraction costs a GPU, counted on a CPU: every dispatched op (a kernel launch on a GPU)
and every host sync of `Detector.detect` with the batched forward and selection, on the real R101-C4 depths
(channels / 8). The budgets hold the GPU path's launch and sync overhead down without a GPU."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from extraction import Detector

OPS_PER_IMAGE = 100  # at a batch of BUDGET_BATCH
SYNCS_PER_BATCH = 2
BUDGET_BATCH = 32
EXTRACTION = str(Path(__file__).resolve().parents[2] / "extraction")
# R101-C4 depths (3, 4, 23 blocks and res5's 3), every width / 8, the real 300 proposals; small pictures,
# a 2x2 pool and a tenth of the classes keep it seconds on a CPU (none changes what is launched)
CENSUS_DETECTOR = dict(
    stem_channels=8,
    res2_channels=32,
    bottleneck_channels=8,
    rpn_channels=64,
    attr_embed_dim=32,
    attr_hidden_dim=64,
    num_classes=160,
    num_attributes=40,
    pooler_resolution=2,
    min_size=96,
    max_size=128,
)
aten = torch.ops.aten
# ops that allocate or describe a tensor without running a kernel on its data
METADATA = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.lift_fresh.default,
    aten.detach.default,
    aten.set_.source_Storage_storage_offset,
}
SYNCING = {  # their output's size (or value) is known only once the device has run them
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten._unique.default,
    aten._unique2.default,
    aten.item.default,
}


def _is_sync(func, args, kwargs) -> bool:
    if func in SYNCING or str(func).startswith("torchvision.nms"):
        return True
    packet = func.overloadpacket
    if packet in (aten.index, aten.index_put, aten.index_put_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    return False


def _site() -> str:
    """The innermost caller in extraction/: module.function:line."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(EXTRACTION):
            module = Path(name).stem
            return f"{module}.{frame.f_code.co_qualname}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside extraction/)"


class Census(TorchDispatchMode):
    """Counts dispatched ops and host syncs by call site; Python-level downloads (`.cpu()`, `.numpy()`,
    `.tolist()`) count as syncs too (on a CPU they dispatch nothing), a `.numpy()` of a `.cpu()` once."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self._patched: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and func not in METADATA:
            site = _site()
            self.ops[site] += 1
            if _is_sync(func, args, kwargs):
                self.syncs[f"{site} {func.overloadpacket.__name__}"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("cpu", "numpy", "tolist"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original
            setattr(torch.Tensor, name, self._downloading(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _downloading(self, name, original):
        census = self

        def download(tensor, *args, **kwargs):
            if not getattr(tensor, "_census_downloaded", False):
                census.syncs[f"{_site()} .{name}()"] += 1
            out = original(tensor, *args, **kwargs)
            if name == "cpu":
                out._census_downloaded = True
            return out

        return download

    def top(self, counter: Counter, n: int = 12) -> str:
        return "\n".join(f"  {count:6d}  {site}" for site, count in counter.most_common(n))


def census_detector(batch: int) -> Detector:
    """The census network, batched forward and selection at `batch` images per call, random weights with a
    peaked class head (a near-uniform one would make the selection's work trivial)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        det = Detector.build(forward="batched", forward_batch=batch, fixed_shapes=True, **CENSUS_DETECTOR)
    with torch.no_grad():
        det.model.roi_heads.box_predictor.cls_score.weight.mul_(200.0)
    return det


def census_images(n: int) -> list[np.ndarray]:
    """`n` landscape pictures (one canvas) of assorted sizes with some structure."""
    rng = np.random.default_rng(0)
    images = []
    for _ in range(n):
        h, w = int(rng.integers(60, 97)), int(rng.integers(97, 129))
        small = rng.integers(0, 256, size=(h // 8, w // 8, 3), dtype=np.uint8)
        images.append(np.ascontiguousarray(np.kron(small, np.ones((8, 8, 1), np.uint8))[:h, :w]))
    return images


def count(det: Detector, images: list[np.ndarray]) -> tuple[Census, list]:
    census = Census()
    with census:
        records = det.detect(images)
    return census, records


@pytest.fixture(scope="module")
def counted():
    torch.set_num_threads(2)
    det = census_detector(BUDGET_BATCH)
    images = census_images(BUDGET_BATCH)
    census, records = count(det, images)
    return det, images, census, records


def test_the_batched_extraction_stays_within_its_launch_and_sync_budget(counted):
    det, images, census, records = counted
    ops, syncs = sum(census.ops.values()), sum(census.syncs.values())
    assert len(records) == len(images)
    assert ops <= OPS_PER_IMAGE * len(images), (
        f"{ops / len(images):.0f} ops per image at batch {len(images)} (budget {OPS_PER_IMAGE}); "
        f"top sites:\n{census.top(census.ops)}"
    )
    assert syncs <= SYNCS_PER_BATCH, (
        f"{syncs} host syncs per batch of {len(images)} (budget {SYNCS_PER_BATCH}); "
        f"top sites:\n{census.top(census.syncs)}"
    )


def test_the_census_sees_what_it_counts(counted):
    """The instrument itself: a boolean mask, an .item() and a .tolist() are syncs; a view is no op."""
    census = Census()
    x = torch.arange(6.0)
    with census:
        x[x > 2].sum().item()
        x.view(2, 3).tolist()
    assert sum(census.syncs.values()) == 3
    assert sum(census.ops.values()) == 4  # gt, index, sum, item
    det, images, _, records = counted
    assert all(r.num_boxes == det.selection.max_boxes for r in records)
    assert len({r.objects_id[0] for r in records}) > 1  # the peaked head picks classes, not ties
