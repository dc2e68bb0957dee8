"""The job's Ray actors: a CPU decoder per replica, and the detector replica (which, in a sharded job,
writes its own shard); both report bad images instead of raising."""

from __future__ import annotations

import threading
import time
from collections import deque

from pipelines.jobs.extract.config import ExtractConfig, recorded_settings
from pipelines.jobs.image_inputs import ImageInput


class DecodedBatch:
    """Images decoded by a decoder, plus the ones that could not be. With `sizes` (each image's original
    (h, w)) the images are already at the detector's working size."""

    def __init__(
        self,
        ids: list[str],
        images: list,
        failures: list[tuple[str, str]],
        sizes: list[tuple[int, int]] | None = None,
    ) -> None:
        self.ids = ids
        self.images = images
        self.failures = failures
        self.sizes = sizes

    def part(self, start: int, stop: int) -> DecodedBatch:
        """Images start..stop, without the failures."""
        sizes = self.sizes[start:stop] if self.sizes is not None else None
        return DecodedBatch(self.ids[start:stop], self.images[start:stop], [], sizes)


class Decoder:
    """Reads and decodes the images of a batch on CPU; a bad file is reported, never raised. Given the
    detector's `working` (min_size, max_size), it also resizes them, so only working-size pixels cross
    to the replica (a 12 MP photo is 36 MB decoded, 1.8 MB at 600/1000). `threads` images are decoded
    at once (PIL releases the GIL while it decodes and resizes): a GPU replica needs several."""

    def __init__(self, timeout: float, working: tuple[int, int] | None = None, threads: int = 1) -> None:
        import extraction  # noqa: F401  (paid here, at start-up, not on the first batch)

        self.timeout = timeout
        self.working = working
        self.threads = threads

    def ready(self) -> bool:
        return True

    def decode(self, items: list[ImageInput]) -> DecodedBatch:
        return decode_images(items, self.timeout, self.working, self.threads)


def decode_images(
    items: list[ImageInput], timeout: float, working: tuple[int, int] | None = None, threads: int = 1
) -> DecodedBatch:
    """Each image read and decoded (and resized to `working`, when given) within `timeout` seconds, or
    reported as failed; `threads` images at a time, results in the items' order."""
    ids, images, failures, sizes = [], [], [], []
    running: deque[tuple[ImageInput, _Load]] = deque()

    def finish() -> None:
        item, load = running.popleft()
        try:
            image, size = load.result(timeout)
            images.append(image)
            sizes.append(size)
            ids.append(item.img_id)
        except Exception as exc:  # any decoder failure is this file's problem, recorded, never the job's
            failures.append((item.img_id, reason(exc)))

    for item in items:
        if len(running) >= max(threads, 1):
            finish()
        running.append((item, _Load(item.path, working)))
    while running:
        finish()
    return DecodedBatch(ids, images, failures, sizes if working is not None else None)


class _Load:
    """(`load_image(path)`, resized to `working` when given; its original (h, w)) on a daemon thread. A
    read stuck past `timeout` (a stalled network mount, a decoder looping on a crafted file) is given up:
    the thread is left to finish or hang on its own, costing one idle thread, while the job goes on with
    the next image.

    The resize is the detector's own (`resize_image` of the full decode, not a reduced JPEG decode), so a
    job's records are bit for bit those of `Detector.detect` on the same files."""

    def __init__(self, path: str, working: tuple[int, int] | None) -> None:
        self.path = path
        self.done: dict = {}
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._work, args=(working,), name="decode", daemon=True)
        self.thread.start()

    def _work(self, working: tuple[int, int] | None) -> None:
        from extraction import load_image
        from extraction.preprocess import resize_image

        try:
            image = load_image(self.path)
            size = image.shape[:2]
            self.done["image"] = (resize_image(image, *working) if working is not None else image), size
        except BaseException as exc:  # handed to the caller's thread
            self.done["error"] = exc

    def result(self, timeout: float):
        from extraction import ImageError

        self.thread.join(max(self.started + timeout - time.monotonic(), 0.0))
        if self.thread.is_alive():
            raise ImageError(
                f"image {self.path!r} was not read and decoded within {timeout:g}s (--decode-timeout); "
                "check the file"
            )
        if "error" in self.done:
            raise self.done["error"]
        return self.done["image"]


class Replica:
    """One detector model; `detect` never raises for a bad image, it reports it.

    Given a `shard` path (and the job's `cfg`), the replica writes its records there itself and returns
    only their ids: the shard is opened on the first batch (after the driver has checked the settings),
    and each call ends with one commit, so an id the driver hears of is on disk, and a call cut short by
    a death leaves all or none of its records. Writes are made under the shard's lock, and only while
    the set names this `job` as its writer (storage.shards.writing)."""

    def __init__(
        self,
        build: dict,
        threads: int,
        shard: str | None = None,
        cfg: ExtractConfig | None = None,
        job: str = "",
    ) -> None:
        import torch

        torch.set_num_threads(threads)
        self.det = self.build_detector(build)
        self.shard = shard
        self.cfg = cfg
        self.job = job  # the token the shard set's manifest names while this job may write it
        self.writer = None

    def build_detector(self, build: dict):
        from extraction import Detector

        return Detector.build(**build)

    def info(self) -> dict:
        return {"provenance": self.det.provenance(), "feature_dim": int(self.det.feature_dim)}

    def detect(self, batch: DecodedBatch) -> tuple[list, list[tuple[str, str]]]:
        if self.shard is None:
            return self._detect(batch)
        records, failures = [], list(batch.failures)
        size = self.cfg.batch_size
        for start in range(0, len(batch.ids), size):
            found, failed = self._detect(batch.part(start, start + size))
            records.extend(found)
            failures.extend(failed)
        from storage.shards import writing

        with writing(self.shard, self.job):
            writer = self._writer()
            for rec in records:
                writer.put(rec)  # False when the shard holds it already: it is there once all the same
            writer.flush()
        return [rec.img_id for rec in records], failures

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _writer(self):
        if self.writer is None:
            from storage import FeatureWriter

            provenance = dict(self.det.provenance())
            provenance["extract_settings"] = recorded_settings(self.cfg, provenance)
            self.writer = FeatureWriter(
                self.shard,
                feature_dim=int(self.det.feature_dim),
                max_boxes=provenance["max_boxes"],  # the grid's cell count for grid features
                dtype=self.cfg.dtype,
                meta=provenance,
                # never mid-call: `detect` commits once at its end
                commit_every=1 << 40,
                commit_bytes=1 << 62,
            )
        return self.writer

    def _detect(self, batch: DecodedBatch) -> tuple[list, list[tuple[str, str]]]:
        failures = list(batch.failures)
        if not batch.images:
            return [], failures
        try:
            return self.det.detect(batch.images, batch.ids, original_sizes=batch.sizes), failures
        except Exception:  # isolate the image that broke the batch instead of failing all of it
            records = []
            for i, (img_id, image) in enumerate(zip(batch.ids, batch.images, strict=True)):
                sizes = [batch.sizes[i]] if batch.sizes is not None else None
                try:
                    records.extend(self.det.detect([image], [img_id], original_sizes=sizes))
                except Exception as exc:
                    failures.append((img_id, f"detection failed: {reason(exc)}"))
            return records, failures


def reason(exc: BaseException) -> str:
    from extraction import ImageError

    return str(exc) if isinstance(exc, ImageError) else f"{type(exc).__name__}: {exc}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
