"""The job's Ray actors: a CPU decoder per replica, and the detector replica; both report bad images
instead of raising."""

from __future__ import annotations

from pipelines.jobs.image_inputs import ImageInput


class DecodedBatch:
    """Images decoded by a decoder, plus the ones that could not be."""

    def __init__(self, ids: list[str], images: list, failures: list[tuple[str, str]]) -> None:
        self.ids = ids
        self.images = images
        self.failures = failures


class Decoder:
    """Reads and decodes the images of a batch on CPU; a bad file is reported, never raised."""

    def __init__(self) -> None:
        import extraction  # noqa: F401  (paid here, at start-up, not on the first batch)

    def ready(self) -> bool:
        return True

    def decode(self, items: list[ImageInput]) -> DecodedBatch:
        return decode_images(items)


def decode_images(items: list[ImageInput]) -> DecodedBatch:
    from extraction import load_image

    ids, images, failures = [], [], []
    for item in items:
        try:
            images.append(load_image(item.path))
            ids.append(item.img_id)
        except Exception as exc:  # any decoder failure is this file's problem, recorded, never the job's
            failures.append((item.img_id, reason(exc)))
    return DecodedBatch(ids, images, failures)


class Replica:
    """One detector model; `detect` never raises for a bad image, it reports it."""

    def __init__(self, build: dict, threads: int) -> None:
        import torch

        from extraction import Detector

        torch.set_num_threads(threads)
        self.det = Detector.build(**build)

    def info(self) -> dict:
        return {"provenance": self.det.provenance(), "feature_dim": int(self.det.feature_dim)}

    def detect(self, batch: DecodedBatch) -> tuple[list, list[tuple[str, str]]]:
        failures = list(batch.failures)
        if not batch.images:
            return [], failures
        try:
            return self.det.detect(batch.images, batch.ids), failures
        except Exception:  # isolate the image that broke the batch instead of failing all of it
            records = []
            for img_id, image in zip(batch.ids, batch.images, strict=True):
                try:
                    records.extend(self.det.detect([image], [img_id]))
                except Exception as exc:
                    failures.append((img_id, f"detection failed: {reason(exc)}"))
            return records, failures


def reason(exc: BaseException) -> str:
    from extraction import ImageError

    return str(exc) if isinstance(exc, ImageError) else f"{type(exc).__name__}: {exc}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
