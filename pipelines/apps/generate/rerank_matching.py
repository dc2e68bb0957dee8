"""Re-ranking DALL-E's candidates by the cross-modal matching head of a retrieval-fine-tuned LXMERT or
ViLBERT (`xmodal finetune --task retrieval`): its score of the (prompt, candidate's regions) pair, in
place of CLIP's similarity."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pipelines.apps.generate.rerank_captioner import RegionReranker
from pipelines.data.regions import image_sizes, inputs_for, pad_regions, region_arrays
from pipelines.data.text import encode_text, pad_text
from pipelines.tasks.finetuned import Finetuned
from pipelines.tasks.retrieval import RetrievalTask
from storage.records import RegionFeatures

log = logging.getLogger(__name__)


@torch.no_grad()
def matching_scores(tuned: Finetuned, prompt: str, regions: Sequence[RegionFeatures]) -> torch.Tensor:
    """(n,) the matching head's score of (`prompt`, each region record), one batch; records without a
    region score -inf."""
    scores = torch.full((len(regions),), float("-inf"))
    rows = [i for i, r in enumerate(regions) if r.num_boxes > 0]
    if len(rows) < len(regions):
        log.warning(
            "%d of %d candidates have no detected region: ranked last", len(regions) - len(rows), len(regions)
        )
    if not rows:
        return scores
    text = encode_text(tuned.tokenizer, prompt, tuned.max_length)
    batch = pad_text([text] * len(rows), tuned.tokenizer.pad_token_id)
    arrays = [region_arrays(regions[i]) for i in rows]
    sizes = image_sizes([regions[i].img_w for i in rows], [regions[i].img_h for i in rows])
    batch.update(pad_regions([f for f, _ in arrays], [b for _, b in arrays], sizes=sizes).model_inputs())
    device = next(tuned.model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs_for(tuned.model, batch).items()}
    inputs["visual_feats"] = inputs["visual_feats"].float()
    scores[torch.tensor(rows)] = tuned.model(**inputs).logits[:, 0].float().cpu()
    return scores


class MatchingReranker(RegionReranker):
    """A retrieval checkpoint (LXMERT / ViLBERT matching head): its score of the prompt with each
    candidate."""

    task_class, flag, what, label = RetrievalTask, "--matcher", "retrieval", "matching"

    def score(self, prompt: str, regions: Sequence[RegionFeatures]) -> torch.Tensor:
        return matching_scores(self.tuned, prompt, regions)
