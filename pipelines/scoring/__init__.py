"""Official VQA v2, GQA and NLVR2 scores of prediction files, computed without a model."""
