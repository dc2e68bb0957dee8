"""The Visual Genome Faster R-CNN (ResNet C4) region-feature extractor.

preprocess (images in) -> rcnn (the network: backbone, rpn, roi_heads, predictor) -> postprocess (decode,
selection, rescale -> storage.RegionFeatures); detector.Detector ties them together; config holds the
presets, provenance what made a store and how to rebuild it, weights the checkpoint readers.
"""

from extraction.detector import Detector
from extraction.preprocess import ImageError, load_image

__all__ = ["Detector", "ImageError", "load_image"]
