"""The Visual Genome Faster R-CNN (ResNet-101 C4) region-feature extractor."""

from extraction.detector import Detector
from extraction.preprocess import ImageError, load_image

__all__ = ["Detector", "ImageError", "load_image"]
