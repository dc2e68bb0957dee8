"""Attention captioners over region features: Show, Attend and Tell and the Up-Down captioner."""

from .captioner import Captioner, CaptionOutput, Context, StepOutput
from .config import CaptionConfig
from .decoding import Beams, Decoded, beam_search, greedy, sample
from .show_attend_tell import HardAttentionCaptioner, ShowAttendTell, SoftAttentionCaptioner
from .updown import UpDownCaptioner

__all__ = [
    "Beams",
    "CaptionConfig",
    "CaptionOutput",
    "Captioner",
    "Context",
    "Decoded",
    "HardAttentionCaptioner",
    "ShowAttendTell",
    "SoftAttentionCaptioner",
    "StepOutput",
    "UpDownCaptioner",
    "beam_search",
    "greedy",
    "sample",
]
