"""`ServeConfig`: where the server listens, how it batches the detector and bounds its work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ServeConfig:
    """How the server listens, batches the detector and bounds its work."""

    RANGES: ClassVar[dict[str, str]] = {
        "port": "[0, 65535]",
        "max_batch": "[1, 4096]",
        "max_wait_ms": "[0, 60000]",
        "max_pending": "[1, 1000000]",
        "timeout_s": "(0, 1000000]",
        "max_upload_mb": "(0, 4096]",
        "body_timeout_s": "(0, 3600]",
        "request_timeout_s": "(0, 3600]",
        "max_connections": "[1, 1000000]",
        "top_k": "[1, 1000]",
        "beam_size": "[1, 1024]",
        "attended": "[1, 4096]",
        "max_question_chars": "[1, 1000000]",
    }

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # images per detector call
    max_wait_ms: float = 5.0  # how long the first queued image waits for others to join its batch
    max_pending: int = 32  # requests waiting for or inside the models; more are refused with 503
    timeout_s: float = 60.0  # a request waiting longer gets a 504
    max_upload_mb: float = 20.0  # request bodies above this are refused with 413
    body_timeout_s: float = 30.0  # a body whose next bytes take longer (shorter than its Content-Length): 408
    # a request (headers and body) not all in this long after its first byte, whatever its pace: 408
    request_timeout_s: float = 60.0
    max_connections: int = 256  # connections held at once (slow clients included); more get 503
    # memory all uploads being decoded may hold at once (about 17 bytes per decoded pixel, so 810 MiB for
    # a 50 MP PNG or WebP; a JPEG decodes at the detector's working size); more wait, then get 503
    max_decode_mb: float = 1024.0
    top_k: int = 5  # answers returned when the request does not say
    beam_size: int = 3  # caption beam width when the request does not say
    attended: int = 5  # regions listed as the answer's most attended
    max_question_chars: int = 500

    def __post_init__(self) -> None:
        for name in (
            "max_batch",
            "max_pending",
            "max_connections",
            "top_k",
            "beam_size",
            "attended",
            "max_question_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_s", "max_upload_mb", "max_decode_mb", "body_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
